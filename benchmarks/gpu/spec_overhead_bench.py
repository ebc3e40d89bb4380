"""What an EAGLE-3 verify step costs on the acceptance benchmark's target shape, and so what acceptance length a
drafter needs to pay there.

The target (acceptance_target.GPU's shape: 64 Llama layers of hidden 1024) and a one-layer EAGLE-3 drafter of
TRAIN.md's draft config are served by SGLang with random weights (``--load-format dummy``, and
``--speculative-draft-load-format dummy`` for the drafter): no training, so this runs in one short device call.
A random drafter's drafts are almost never accepted, so each request advances about one token per verify step:
its decode rate is the rate of verify steps (3 draft steps, a 4-token verify, the draft extend, the scheduler's
work). Served as acceptance_bench serves its arms (same flags, same prompts shape, greedy, ``ignore_eos``, fixed
output length, 1 / 8 / 32 in flight), the ratio gives the break-even: a drafter accepting ``tau`` tokens per step
runs at about ``tau`` times the measured verify-step rate, so the speed-up over no drafter is
``tau * rate_with_drafter / tau_measured / rate_without``, and ``tau`` needed for a speed-up S is S over that.

`--smoke` serves the tiny shape without a drafter on the CPU SGLang (it cannot run speculative decoding) and writes
the report into the work folder.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from transformers import LlamaConfig

from benchmarks import report
from benchmarks.common import log, sglang_python
from benchmarks.gpu.acceptance_bench import (
    CONCURRENCY,
    CPU_ARGS,
    CPU_NO_SPECULATIVE,
    GPU_SERVE_ARGS,
    KIMI,
    NO_DRAFTER,
    SMOKE_CONCURRENCY,
    PlainServer,
    measure_runs,
)
from benchmarks.gpu.acceptance_target import GPU, SMOKE, Sizes
from harness.processes import REPO_ROOT
from harness.sglang import cpu_server_env
from layertap.engines.sglang import SGLangServer

DRAFTER = "random drafter"
PROMPT_TOKENS = 256  # about the acceptance benchmark's held-out prompts (the head of a file, ~900 characters)


def write_folders(work: Path, sizes: Sizes) -> tuple[Path, Path]:
    """Config-only folders of the target and of its EAGLE-3 drafter (TRAIN.md's draft config: the target's
    width, one layer, the full vocabulary, aux ids = capture indices - 1)."""
    shape = {"vocab_size": sizes.vocab, "hidden_size": sizes.hidden, "num_attention_heads": sizes.heads,
             "num_key_value_heads": sizes.kv_heads, "intermediate_size": sizes.intermediate,
             "max_position_embeddings": 4096, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 3,
             "pad_token_id": 1}  # fmt: skip
    target, drafter = work / "target", work / "drafter"
    LlamaConfig(**shape, num_hidden_layers=sizes.layers, architectures=["LlamaForCausalLM"]).save_pretrained(target)
    draft = LlamaConfig(**shape, num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"]).to_dict()
    draft |= {"draft_vocab_size": sizes.vocab,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [c - 1 for c in sizes.capture]}}  # fmt: skip
    drafter.mkdir(parents=True, exist_ok=True)
    (drafter / "config.json").write_text(json.dumps(draft, indent=1))
    return target, drafter


def serve(work: Path, name: str, target: Path, drafter: Path, smoke: bool, prompts: list[list[int]],
          concurrency: tuple[int, ...], sizes: Sizes) -> dict[str, Any]:  # fmt: skip
    """One server (random weights), warmed by one request, measured at each concurrency, stopped."""
    args = [*(CPU_ARGS if smoke else (*GPU_SERVE_ARGS, "--mem-fraction-static", "0.80")), "--load-format", "dummy"]
    if name == DRAFTER:
        args += [*KIMI.flags(), "--speculative-draft-model-path", str(drafter), "--speculative-draft-load-format",
                 "dummy"]  # fmt: skip
    config = PlainServer(python=sglang_python(smoke), model=target, dump_root=work, layers=(), final="post",
                         log_path=work / f"{name.replace(' ', '-')}.log", sglang_args=tuple(args),
                         env=cpu_server_env() if smoke else {})  # fmt: skip
    server = SGLangServer(config)
    server.launch()
    try:
        t0 = time.monotonic()
        server.wait_ready()
        started = time.monotonic() - t0
        runs = measure_runs(name, server, prompts, sizes, concurrency)
    finally:
        server.stop()
    for r in runs:
        r.pop("accept_lengths", None)
    log(f"{name}: " + json.dumps(runs))
    return {"arm": name, "flags": " ".join(args), "start_s": started, "runs": runs}


def table(base: dict[str, Any], spec: dict[str, Any] | None) -> list[list[object]]:
    """Per concurrency: the decode rates, the time of a decode / verify step, and the acceptance length a drafter
    needs for a speed-up of 1 and of 1.8 (tau = S * rate without / (rate with / tau measured))."""
    rows = []
    for i, b in enumerate(base["runs"]):
        step_ms = 1000 * b["in_flight"] / b["tok_s"]
        if spec is None:
            rows.append([b["in_flight"], f"{b['tok_s']:,.0f}", f"{step_ms:.2f}", CPU_NO_SPECULATIVE, "", "", "", ""])
            continue
        s = spec["runs"][i]
        steps_per_s = s["tok_s"] / s["tokens_per_verify"]  # verify steps a second, summed over the requests
        verify_ms = 1000 * s["in_flight"] / steps_per_s
        rows.append([b["in_flight"], f"{b['tok_s']:,.0f}", f"{step_ms:.2f}", f"{s['tok_s']:,.0f}",
                     f"{s['tokens_per_verify']:.3f}", f"{verify_ms:.2f}",
                     f"{b['tok_s'] / steps_per_s:.2f}", f"{1.8 * b['tok_s'] / steps_per_s:.2f}"])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--work", type=Path, default=Path("/tmp/layertap-spec-overhead"))
    ap.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/gpu_spec_overhead.md "
                    "(smoke: WORK/spec_overhead.md)")  # fmt: skip
    args = ap.parse_args(argv)
    sizes, concurrency = (SMOKE, SMOKE_CONCURRENCY) if args.smoke else (GPU, CONCURRENCY)
    out = args.out or (args.work / "spec_overhead.md" if args.smoke else
                       REPO_ROOT / "benchmarks" / "results" / "gpu_spec_overhead.md")  # fmt: skip
    args.work.mkdir(parents=True, exist_ok=True)
    target, drafter = write_folders(args.work, sizes)
    rng = random.Random(20261203)
    prompts = [[rng.randrange(10, sizes.vocab) for _ in range(PROMPT_TOKENS)] for _ in range(sizes.prompts)]
    base = serve(args.work, NO_DRAFTER, target, drafter, args.smoke, prompts, concurrency, sizes)
    spec = None if args.smoke else serve(args.work, DRAFTER, target, drafter, args.smoke, prompts, concurrency, sizes)
    head = ["in flight", "tok/s without drafter", "decode step ms", "tok/s with random drafter",
            "tokens per verify step", "verify step ms", "acceptance length for 1.0x", "for 1.8x"]  # fmt: skip
    lines = [f"# What an EAGLE-3 verify step costs on the acceptance target's shape ("
             f"{'CPU smoke test' if args.smoke else 'one H200, SGLang 0.5.14'})", "",
             f"Written by `benchmarks/gpu/spec_overhead_bench.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())},"
             f" commit {report.git_commit()}). Target: Llama, {sizes.layers} layers, hidden {sizes.hidden}, "
             f"{sizes.heads} heads ({sizes.kv_heads} key-value), MLP {sizes.intermediate}, vocabulary {sizes.vocab}, "
             "random weights (`--load-format dummy`). Drafter: TRAIN.md's EAGLE-3 draft config for it "
             "(one layer, aux ids = capture indices - 1), random weights; EAGLE3, 3 steps, top-k 1, 4 draft tokens. "
             f"{sizes.prompts} prompts of {PROMPT_TOKENS} random token ids ({sizes.prompts_c1} one at a time), "
             f"greedy, exactly {sizes.max_new_tokens} new tokens each (`ignore_eos`). Servers up in "
             f"{base['start_s']:.0f} s (no drafter)"
             + (f" and {spec['start_s']:.0f} s (drafter)." if spec else "."), "",
             *report.table_lines(head, table(base, spec)), "",
             "Acceptance length for S: the verify steps' rate is what a drafter's decode rate is per accepted "
             "token, so a drafter accepting tau tokens per step decodes at about tau times it; tau = S x (tok/s "
             "without) / (verify steps/s). A random drafter's verify steps accept almost nothing, so their KV "
             "bookkeeping is a little lighter than a trained drafter's: these figures are a lower bound on what "
             "a drafter needs.", "", "Servers (`python -m sglang.launch_server --model-path TARGET` plus):", "",
             "```", *(f"{r['arm']}: {r['flags']}" for r in (base, spec) if r), "```", ""]  # fmt: skip
    parameters = {"sizes": {k: getattr(sizes, k) for k in ("layers", "hidden", "heads", "kv_heads", "intermediate",
                  "vocab", "capture", "prompts", "prompts_c1", "max_new_tokens")}, "concurrency": concurrency,
                  "prompt_tokens": PROMPT_TOKENS, "smoke": args.smoke}  # fmt: skip
    text = "\n".join(lines).replace(str(args.work), "$WORK").replace(sys.executable, "python3")
    report.write(out, report.result("spec_overhead", text, parameters=parameters, rows=[r for r in (base, spec) if r]))
    log(f"report: {out}")
