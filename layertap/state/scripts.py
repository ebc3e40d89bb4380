"""Lua scripts for the state changes that must read-and-write atomically (one round trip each).

Every script takes its keys in KEYS (built by ``keys.Keys``) and checks the caller's token first: a
worker whose shard was requeued, or a message from an older dispatch, can never move state. Times
come from the Redis server's clock, so workers and coordinator clocks may disagree.
"""

from __future__ import annotations

from redis.commands.core import Script

_NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end
"""


def _script(body: str) -> Script:
    # Bytes, so the sha is computed without a client; the caller passes its client (or pipeline).
    return Script(None, (_NOW + body).encode())  # type: ignore[arg-type]


# KEYS: job, shard, seq. Gives a pending shard of a running job a fresh token; returns it, or nil.
DISPATCH = _script("""
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return false end
if redis.call('HGET', KEYS[2], 'state') ~= 'pending' then return false end
local token = tostring(redis.call('INCR', KEYS[3]))
redis.call('HSET', KEYS[2], 'state', 'queued', 'token', token, 'queued_ms', now_ms())
return token
""")

# KEYS: job, shard, lease. ARGV: token, worker, lease_ms. Returns {'ok', spec, start, stop, attempts}
# or {why not}. A redelivered message may take over a running shard only once its lease has expired.
CLAIM = _script("""
local job = redis.call('HMGET', KEYS[1], 'state', 'spec')
if not job[1] then return {'missing'} end
local s = redis.call('HMGET', KEYS[2], 'state', 'token', 'start', 'stop')
if s[2] ~= ARGV[1] then return {'stale'} end
if s[1] == 'done' then return {'done'} end
if job[1] ~= 'running' then return {'inactive'} end
if s[1] == 'running' and redis.call('EXISTS', KEYS[3]) == 1 then return {'busy'} end
if s[1] ~= 'queued' and s[1] ~= 'running' then return {'stale'} end
redis.call('HSET', KEYS[2], 'state', 'running', 'worker', ARGV[2], 'claimed_ms', now_ms())
local attempts = redis.call('HINCRBY', KEYS[2], 'attempts', 1)
redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[3])
return {'ok', job[2], s[3], s[4], attempts}
""")

# KEYS: shard, errors. ARGV: token, done, tokens. Counters restart from what the store holds.
START = _script("""
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'done', ARGV[2], 'tokens', ARGV[3], 'failed', 0)
redis.call('DEL', KEYS[2])
return 1
""")

# KEYS: job, shard, job_workers. ARGV: token, tokens, worker. Returns the job state, or 'lost'.
SAMPLE_DONE = _script("""
local job_state = redis.call('HGET', KEYS[1], 'state') or 'missing'
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[1] then return 'lost' end
redis.call('HINCRBY', KEYS[2], 'done', 1)
redis.call('HINCRBY', KEYS[2], 'tokens', ARGV[2])
redis.call('HINCRBY', KEYS[3], ARGV[3] .. ':samples', 1)
redis.call('HINCRBY', KEYS[3], ARGV[3] .. ':tokens', ARGV[2])
return job_state
""")

# KEYS: job, shard. ARGV: token, tokens. Returns the job state, or 'lost'.
SAMPLE_RETIRED = _script("""
local job_state = redis.call('HGET', KEYS[1], 'state') or 'missing'
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[1] then return 'lost' end
redis.call('HINCRBY', KEYS[2], 'done', -1)
redis.call('HINCRBY', KEYS[2], 'tokens', -tonumber(ARGV[2]))
return job_state
""")

# KEYS: job, shard, generation. ARGV: token, row, tokens, cut turns. Returns the job state, or 'lost'. Keyed by row,
# so a row regenerated again (its first attempt died before the commit) replaces its figures instead of adding them.
ROW_GENERATED = _script("""
local job_state = redis.call('HGET', KEYS[1], 'state') or 'missing'
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[1] then return 'lost' end
local tokens, cut = tonumber(ARGV[3]), tonumber(ARGV[4])
local old = redis.call('HGET', KEYS[3], ARGV[2])
if old then
  local t, c = string.match(old, '^(%d+) (%d+)$')
  tokens, cut = tokens - tonumber(t), cut - tonumber(c)
else
  redis.call('HINCRBY', KEYS[2], 'generated_rows', 1)
end
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3] .. ' ' .. ARGV[4])
redis.call('HINCRBY', KEYS[2], 'generated', tokens)
redis.call('HINCRBY', KEYS[2], 'cut', cut)
return job_state
""")

# KEYS: job, shard, errors. ARGV: token, row, failure JSON. Returns the job state, or 'lost'.
SAMPLE_FAILED = _script("""
local job_state = redis.call('HGET', KEYS[1], 'state') or 'missing'
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[1] then return 'lost' end
if redis.call('HSET', KEYS[3], ARGV[2], ARGV[3]) == 1 then redis.call('HINCRBY', KEYS[2], 'failed', 1) end
return job_state
""")

# KEYS: job, shard, lease, open, failed, finalize_lease. ARGV: token, done, tokens, failed, lease_ms,
# shard. Exactly one completion (the one that empties `open`) wins the right to finalize.
COMPLETE = _script("""
local s = redis.call('HMGET', KEYS[2], 'state', 'token')
if s[1] ~= 'running' or s[2] ~= ARGV[1] then return 'lost' end
redis.call('HSET', KEYS[2], 'state', 'done', 'done', ARGV[2], 'tokens', ARGV[3], 'failed', ARGV[4],
           'finished_ms', now_ms())
redis.call('DEL', KEYS[3])
redis.call('SREM', KEYS[4], ARGV[6])
redis.call('SREM', KEYS[5], ARGV[6])
if redis.call('HGET', KEYS[1], 'state') ~= 'running' then return 'done' end
local open = redis.call('SCARD', KEYS[4])
if open == 0 then
  redis.call('HSET', KEYS[1], 'state', 'finalizing', 'finalize_token', ARGV[1])
  redis.call('SET', KEYS[6], ARGV[1], 'PX', ARGV[5])
  return 'finalize'
end
if redis.call('SCARD', KEYS[5]) >= open then
  redis.call('HSET', KEYS[1], 'state', 'failed')
end
return 'done'
""")

# KEYS: job, shard, lease, open, failed. ARGV: token, error, shard. The job fails once every shard
# still open has failed.
FAIL = _script("""
if redis.call('HGET', KEYS[2], 'token') ~= ARGV[1] then return 'lost' end
redis.call('HSET', KEYS[2], 'state', 'failed', 'error', ARGV[2], 'finished_ms', now_ms())
redis.call('DEL', KEYS[3])
redis.call('SADD', KEYS[5], ARGV[3])
if redis.call('HGET', KEYS[1], 'state') == 'running'
   and redis.call('SCARD', KEYS[5]) >= redis.call('SCARD', KEYS[4]) then
  redis.call('HSET', KEYS[1], 'state', 'failed', 'error', 'shard ' .. ARGV[3] .. ': ' .. ARGV[2])
  return 'job-failed'
end
return 'failed'
""")

# KEYS: shard, lease. ARGV: token, 'pending' (forget the token: cancel, lease lost) or 'queued'
# (keep it: the same message comes back as a Celery retry), retry delay ms. A retried shard counts
# as queued from when its message is due, so the reaper's lost-message grace starts then.
RELEASE = _script("""
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
if ARGV[2] == 'pending' then
  redis.call('HSET', KEYS[1], 'state', 'pending', 'token', '')
else
  redis.call('HSET', KEYS[1], 'state', 'queued', 'queued_ms', now_ms() + tonumber(ARGV[3]))
end
redis.call('DEL', KEYS[2])
return 1
""")

# KEYS: hash (shard or job), lease. ARGV: token, lease_ms, expected state, token field. Renews (or
# re-creates, e.g. after a Redis restart lost it) the lease of a holder that still owns its work.
HEARTBEAT = _script("""
local h = redis.call('HMGET', KEYS[1], 'state', ARGV[4])
if h[1] ~= ARGV[3] or h[2] ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return 1
""")

# KEYS: shard, lease. ARGV: token, state... Back to pending if the shard still has that token, is in
# one of the given states and nobody holds its lease (the reaper's and resume's one move). A failed
# shard (only resume moves those) gets its claim count back to 0.
REQUEUE = _script("""
local s = redis.call('HMGET', KEYS[1], 'state', 'token')
if s[2] ~= ARGV[1] or redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
for i = 2, #ARGV do
  if s[1] == ARGV[i] then
    redis.call('HSET', KEYS[1], 'state', 'pending', 'token', '')
    if s[1] == 'failed' then redis.call('HSET', KEYS[1], 'attempts', 0) end
    return 1
  end
end
return 0
""")

# KEYS: job, finalize_lease, seq. ARGV: lease_ms. A finalizing job whose finalizer is gone gets a new
# finalize token (returned), or nil.
REFINALIZE = _script("""
if redis.call('HGET', KEYS[1], 'state') ~= 'finalizing' or redis.call('EXISTS', KEYS[2]) == 1 then
  return false
end
local token = tostring(redis.call('INCR', KEYS[3]))
redis.call('HSET', KEYS[1], 'finalize_token', token)
redis.call('SET', KEYS[2], token, 'PX', ARGV[1])
return token
""")

# KEYS: job, finalize_lease. ARGV: token, lease_ms. Returns the job spec JSON to the finalizer, or nil.
CLAIM_FINALIZE = _script("""
local j = redis.call('HMGET', KEYS[1], 'state', 'finalize_token', 'spec')
if j[1] ~= 'finalizing' or j[2] ~= ARGV[1] then return false end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then return false end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return j[3]
""")

# KEYS: job, finalize_lease. ARGV: token, final state ('done', or 'failed' when the outcome is not what
# was asked), error ('' when done).
FINISH = _script("""
local j = redis.call('HMGET', KEYS[1], 'state', 'finalize_token')
if j[1] ~= 'finalizing' or j[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'finished_ms', now_ms(), 'error', ARGV[3])
redis.call('DEL', KEYS[2])
return 1
""")

# KEYS: job. Returns the state before: only a running or failed job can be cancelled.
CANCEL = _script("""
local st = redis.call('HGET', KEYS[1], 'state')
if st == 'running' or st == 'failed' then redis.call('HSET', KEYS[1], 'state', 'cancelled') end
return st or 'missing'
""")

# KEYS: job, open, seq, finalize_lease, failed. ARGV: lease_ms. Returns {what, token}: 'running'
# (dispatch its pending shards), 'finalize' (every shard is done: finalize with token), or the
# state that cannot be resumed ('done', 'finalizing', 'missing').
RESUME = _script("""
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return {'missing'} end
if st == 'done' or st == 'finalizing' then return {st} end
if redis.call('SCARD', KEYS[2]) == 0 then
  local token = tostring(redis.call('INCR', KEYS[3]))
  redis.call('HSET', KEYS[1], 'state', 'finalizing', 'finalize_token', token)
  redis.call('SET', KEYS[4], token, 'PX', ARGV[1])
  return {'finalize', token}
end
redis.call('HSET', KEYS[1], 'state', 'running', 'error', '')
redis.call('DEL', KEYS[5])
return {'running'}
""")

# KEYS: job, audit, audit_lease, seq. ARGV: worker, lease_ms. Returns {'ok', token, spec}, or {why not}: the
# job asked for no audit ('missing'), its verdict is recorded ('done'), the job has not ended ('inactive'), or
# a live worker runs it ('busy'). A redelivered message takes over an audit only once its lease has expired.
CLAIM_AUDIT = _script("""
local job = redis.call('HMGET', KEYS[1], 'state', 'spec')
local audit = redis.call('HGET', KEYS[2], 'state')
if not job[1] or not audit then return {'missing'} end
if audit ~= 'pending' and audit ~= 'running' then return {'done'} end  -- a verdict, or error
if job[1] ~= 'done' and job[1] ~= 'failed' then return {'inactive'} end
if redis.call('EXISTS', KEYS[3]) == 1 then return {'busy'} end
local token = tostring(redis.call('INCR', KEYS[4]))
redis.call('HDEL', KEYS[2], 'device', 'layers_done', 'layers_total')  -- a dead worker's progress is not this run's
redis.call('HSET', KEYS[2], 'state', 'running', 'token', token, 'worker', ARGV[1], 'started_ms', now_ms())
redis.call('HINCRBY', KEYS[2], 'attempts', 1)
redis.call('SET', KEYS[3], token, 'PX', ARGV[2])
return {'ok', token, job[2]}
""")

# KEYS: audit. ARGV: token, device, layers done, layers total. Written only by the running audit's holder.
AUDIT_PROGRESS = _script("""
local a = redis.call('HMGET', KEYS[1], 'state', 'token')
if a[1] ~= 'running' or a[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'device', ARGV[2], 'layers_done', ARGV[3], 'layers_total', ARGV[4])
return 1
""")

# KEYS: audit, audit_lease. ARGV: token, then field, value... of the verdict. Written only by the audit's holder.
FINISH_AUDIT = _script("""
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'finished_ms', now_ms(), unpack(ARGV, 2))
redis.call('DEL', KEYS[2])
return 1
""")

# A stream's consumer groups (`layertap.stream.consumer`): each group gets every sample; a sample is delivered once
# every group registered at or before its entry (the entry id's ms) has acked it, or settled once one dead-letters it.

# KEYS: stream, groups. ARGV: group. Registers the group (its first registration's time kept) and creates it.
STREAM_JOIN = _script("""
redis.call('HSETNX', KEYS[2], ARGV[1], now_ms())
pcall(redis.call, 'XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')  -- BUSYGROUP: it exists
return 1
""")

# KEYS: stream, groups, acked, dead. ARGV: group, entry id, sample id, consumer. The group's ack (XACK, its record
# in `acked:{group}`); the ack that completes the acks of every group the sample waits for records it in `acked`.
# Returns {XACK's count, 1 if this ack completed them (its caller removes the object) else 0}.
STREAM_ACK = _script("""
local xacked = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if redis.call('HEXISTS', KEYS[4], ARGV[3]) == 1 then return {xacked, 0} end  -- dead-lettered: settled already
redis.call('HSETNX', KEYS[3] .. ':' .. ARGV[1], ARGV[3], ARGV[4])
if redis.call('HEXISTS', KEYS[3], ARGV[3]) == 1 then return {xacked, 0} end
local put_ms = tonumber(string.match(ARGV[2], '^(%d+)'))
local groups = redis.call('HGETALL', KEYS[2])
for i = 1, #groups, 2 do
  if tonumber(groups[i + 1]) <= put_ms and redis.call('HEXISTS', KEYS[3] .. ':' .. groups[i], ARGV[3]) == 0 then
    return {xacked, 0}
  end
end
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
return {xacked, 1}
""")

# KEYS: stream, groups, acked, dead. ARGV: group, entry id, sample id, why (JSON). Acks the entry out of the group
# and dead-letters the sample, settled for every group (their acks of it forgotten, so none counts it twice), unless
# it was delivered already. Returns 1 if this call dead-lettered it (its caller removes the object).
STREAM_NACK = _script("""
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if redis.call('HEXISTS', KEYS[3], ARGV[3]) == 1 then return 0 end
if redis.call('HSETNX', KEYS[4], ARGV[3], ARGV[4]) == 0 then return 0 end
for _, group in ipairs(redis.call('HKEYS', KEYS[2])) do redis.call('HDEL', KEYS[3] .. ':' .. group, ARGV[3]) end
return 1
""")
