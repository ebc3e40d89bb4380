"""H200 run for the capture issue: HF equality on a larger dummy model, then prefill throughput
without capture vs with capture + commit at 1/4/16/64 requests in flight. Writes a markdown table.

Run on the device (sglang 0.5.14 installed into /tmp/site from the two wheel chunks):
    PYTHONPATH=/tmp/site:. python3 benchmarks/gpu/capture_bench.py --out $OUT
"Plain" prefill is measured on the same server with rids outside the capture namespace: the hooks
return after one string test, so it is the server's own prefill rate (no D2H, no dump, no commit).

``--layout specforge`` (the default) runs the server as `layertap extract --engine sglang` does for a
specforge store: it writes each sample's .ckpt itself (post-norm final only), into a dump root on the
store's filesystem, so a commit is a check plus a rename. ``--layout states`` dumps every state (both
finals) to /dev/shm and the worker writes the .ckpt (the path measured before native dumps existed).
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from layertap.engines.sglang import SGLangEngine
from layertap.engines.sglang_server import ServerConfig, SGLangServer
from layertap.models.tiny import build_tiny_model, model_dims
from layertap.pipeline import run_shard
from layertap.spec import ExtractionSpec, resolve_capture
from layertap.store.manifest import build_manifest
from layertap.store.store import OutputStore

GPU_ARGS = ("--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
            "--grammar-backend", "none", "--disable-cuda-graph", "--chunked-prefill-size", "4096",
            "--mem-fraction-static", "0.55", "--dtype", "bfloat16")  # fmt: skip
SHAPE = dict(hidden_size=4096, num_hidden_layers=8, intermediate_size=14336, num_attention_heads=32,
             num_key_value_heads=8)  # fmt: skip
DEVICE = "cuda"
LAYERS = (2, 4, 6)  # capture indices; with the post-norm final: 4 states/token, 32 KB/token in bf16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def equality(server: SGLangServer, model: Path, dumps: Path, final: str, out_lines: list[str]) -> None:
    """Every captured state vs HF on the same weights: float32 math is the reference; HF in bf16
    shows how far plain bf16 arithmetic already strays, which sets the stated tolerance."""
    from transformers import AutoModelForCausalLM

    num_layers, _ = model_dims(model)
    spec = resolve_capture(LAYERS, convention="capture", num_layers=num_layers, final=final)
    engine = SGLangEngine(server, spec, dump_root=dumps, job="eq", in_flight=16)
    rng = random.Random(0)
    lengths = [1, 4000] + [int(math.exp(rng.uniform(0, math.log(4000)))) for _ in range(30)]
    g = torch.Generator().manual_seed(1)
    from layertap.sample import TokenizedSample

    samples = [TokenizedSample(f"e{i}", i, torch.randint(4, 1500, (t,), generator=g), torch.ones(t, dtype=torch.uint8))
               for i, t in enumerate(lengths)]  # fmt: skip
    got = {c.sample.sample_id: c for c in engine.capture(samples)}
    assert len(got) == len(samples) and all(hasattr(c, "aux") for c in got.values()), "missing/failed samples"
    worst = {"sglang_bf16": 0.0, "hf_bf16": 0.0}
    for dtype, key in ((torch.float32, "ref"), (torch.bfloat16, "hf_bf16")):
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(DEVICE).eval()
        pre: dict[str, torch.Tensor] = {}
        hf.model.norm.register_forward_pre_hook(lambda _m, a, pre=pre: pre.__setitem__("x", a[0]))
        outs = {}
        with torch.no_grad():
            for s in samples:
                hs = hf(s.input_ids[None].to(DEVICE), output_hidden_states=True).hidden_states
                outs[s.sample_id] = (
                    [hs[i][0].float().cpu() for i in LAYERS],
                    hs[-1][0].float().cpu(),
                    pre["x"][0].float().cpu(),
                )
        if key == "ref":
            ref = outs
        else:
            for sid, (aux, post, pre_) in outs.items():
                r = ref[sid]
                worst["hf_bf16"] = max(
                    worst["hf_bf16"],
                    *(rel(a, b) for a, b in zip(aux, r[0], strict=True)),
                    rel(post, r[1]),
                    rel(pre_, r[2]),
                )
        del hf
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    for sid, c in got.items():
        r = ref[sid]
        errs = [rel(c.aux[:, j], r[0][j]) for j in range(len(LAYERS))] + [
            rel(t, ref_t) for t, ref_t in ((c.final_post, r[1]), (c.final_pre, r[2])) if t is not None
        ]
        worst["sglang_bf16"] = max(worst["sglang_bf16"], *errs)
        off_by_one = rel(c.aux[:, 0], r[0][1])
        assert off_by_one > 0.1, "states do not discriminate layers"
    for c in got.values():
        engine.release(c)
    tol = max(2 * worst["hf_bf16"], 1e-2)
    ok = worst["sglang_bf16"] < tol
    out_lines += [
        "## Equality with HF (same weights, GPU)", "",
        f"{len(samples)} prompts of 1..4000 tokens, 16 in flight, chunked prefill 4096; capture indices {list(LAYERS)} + final {final}.",
        "Relative error = ||x - ref|| / ||ref|| per tensor, reference = HF transformers in float32 on the same bf16 weights.", "",
        "| compared | worst relative error |", "|---|---|",
        f"| SGLang bf16 capture vs HF float32 | {worst['sglang_bf16']:.2e} |",
        f"| HF bf16 vs HF float32 (bf16 arithmetic alone) | {worst['hf_bf16']:.2e} |",
        "", f"Stated bf16 tolerance: max(2 x HF-bf16 error, 1e-2) = {tol:.2e} -> {'PASS' if ok else 'FAIL'}", "",
    ]  # fmt: skip


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1500) for _ in range(rng.randint(512, 4000))] for _ in range(n)]


def plain_rate(url: str, batch: list[list[int]], in_flight: int) -> float:
    client = httpx.Client(timeout=600)

    def one(ids: list[int]) -> None:
        body = {"input_ids": ids, "rid": f"plain-{uuid.uuid4().hex}", "sampling_params": {"max_new_tokens": 0}}
        assert client.post(url + "/generate", json=body).status_code == 200

    t0 = time.perf_counter()
    with ThreadPoolExecutor(in_flight) as pool:
        list(pool.map(one, batch))
    return sum(map(len, batch)) / (time.perf_counter() - t0)


def capture_rate(server, model, dumps, store_root, batch, in_flight) -> tuple[float, float]:
    """Prefill + capture + validate + commit into a specforge store on local disk (bf16 states)."""
    import json

    data = store_root.parent / f"data-{in_flight}.jsonl"
    data.write_text("".join(json.dumps({"id": f"b{i}", "input_ids": ids}) + "\n" for i, ids in enumerate(batch)))
    spec = ExtractionSpec(model=model, data=data, layers=LAYERS, format="specforge")
    num_layers, hidden = model_dims(model)
    cap = spec.resolve(num_layers)
    engine = SGLangEngine(server, cap, dump_root=dumps, job=f"bench{in_flight}", in_flight=in_flight)
    manifest = build_manifest(spec, cap, hidden_size=hidden, compute_dtype="bfloat16", dataset_rows=len(batch),
                              engine=engine.describe())  # fmt: skip
    shutil.rmtree(store_root, ignore_errors=True)
    store = OutputStore.create_or_resume(store_root, manifest)
    t0 = time.perf_counter()
    report = run_shard(spec, store, engine, check_level="quick")
    dt = time.perf_counter() - t0
    assert len(report.computed) == len(batch) and report.failed == 0, report
    nbytes = sum(r.nbytes for r in store.records().values())
    return report.tokens / dt, nbytes / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench"))
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--layout", choices=["specforge", "states"], default="specforge", help="the server's dump layout")
    ap.add_argument("--in-flight", default="1,4,16,64", help="comma-separated requests-in-flight settings")
    ap.add_argument("--skip-equality", action="store_true", help="throughput only (equality already shown)")
    ap.add_argument("--cpu-smoke", action="store_true", help="Try the script on a CPU server with the tiny model.")
    args = ap.parse_args()
    global DEVICE, GPU_ARGS, SHAPE, LAYERS
    python = Path(shutil.which("python3"))
    if args.cpu_smoke:  # the same code path on this machine's CPU SGLang, to debug before using GPU time
        from layertap.engines.sglang_server import CPU_SERVER_ARGS

        DEVICE, SHAPE, LAYERS = "cpu", {}, (1, 3, 5)
        GPU_ARGS = (*CPU_SERVER_ARGS, "--dtype", "bfloat16", "--chunked-prefill-size", "512")
        python = Path("/opt/sglang-venv/bin/python")
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    model = build_tiny_model("llama", args.work / "model", dtype=torch.bfloat16, **SHAPE)
    print(f"model built in {time.time() - t_start:.0f}s", flush=True)
    # Native dumps go where the store is (commit = rename); "states" dumps to tmpfs as before.
    native = args.layout != "states"
    dumps = args.work / "dumps" if native else Path("/dev/shm/layertap-dumps")
    final = "post" if native else "both"
    env = (
        {"SGLANG_USE_CPU_ENGINE": "1", "LD_LIBRARY_PATH": "/opt/sglang-venv/layertap-cuda-stub"}
        if args.cpu_smoke
        else {}
    )
    cfg = ServerConfig(python=python, env=env, model=model, dump_root=dumps, layers=LAYERS, final=final,
                       layout=args.layout, log_path=args.out / "server.log", sglang_args=GPU_ARGS)  # fmt: skip
    server = SGLangServer(cfg)
    server.start()
    print(f"server up at {time.time() - t_start:.0f}s", flush=True)
    lines = ["# SGLang capture on one H200 (sglang 0.5.14)", "",
             f"Model: random-weight Llama, {SHAPE}, bf16. Server flags: `{' '.join(GPU_ARGS)}`; "
             f"dump layout `{args.layout}`, dumps in {dumps}.", ""]  # fmt: skip
    try:
        plain_rate(server.url, prompts(2, 99), 2)  # JIT warm-up of kernels on first requests
        if not args.skip_equality:
            equality(server, model, dumps, final, lines)
            print(f"equality done at {time.time() - t_start:.0f}s", flush=True)
        (args.out / "results.md").write_text("\n".join(lines))
        batch = prompts(args.prompts, 7)
        rows: list[tuple[int, float, float, float]] = []
        for n in map(int, args.in_flight.split(",")):
            plain = plain_rate(server.url, batch, n)
            tok_s, bytes_s = capture_rate(server, model, dumps, args.work / "store", batch, n)
            rows.append((n, plain, tok_s, bytes_s))
            print(
                f"in_flight={n}: plain {plain:,.0f} tok/s, capture {tok_s:,.0f} tok/s, {bytes_s / 1e9:.2f} GB/s",
                flush=True,
            )
            (args.out / "results.md").write_text("\n".join(lines + throughput_table(rows, args.prompts, args.layout)))
    finally:
        server.stop()
    print((args.out / "results.md").read_text())


def throughput_table(rows: list[tuple[int, float, float, float]], n_prompts: int, layout: str) -> list[str]:
    best = max(r[2] for r in rows) / max(r[1] for r in rows)
    path = (
        "the server writes the .ckpt beside the store + validate (finite, shapes, ids, loss mask, sha256) + rename"
        if layout != "states"
        else "dump to /dev/shm + validate + commit (specforge .ckpt, bf16, sha256, fsync)"
    )
    return [
        "## Throughput", "",
        f"{n_prompts} prompts of 512..4000 tokens (random ids), max_new_tokens 0. Capture = prefill + D2H +",
        f"{path}, into a store on the local disk.", "",
        "| in flight | plain prefill tok/s | capture+commit tok/s | ratio | bytes written/s |", "|---|---|---|---|---|",
        *[f"| {n} | {p:,.0f} | {c:,.0f} | {c / p:.2f} | {b / 1e9:.2f} GB/s |" for n, p, c, b in rows],
        "", f"Best capture / best plain = {best:.2f} (target >= 0.90).", "",
    ]  # fmt: skip


if __name__ == "__main__":
    main()
