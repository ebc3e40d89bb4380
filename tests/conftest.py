"""Shared pytest fixtures. Keep each group together under its heading."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from xdist.scheduler import LoadFileScheduling

from layertap.tiny import build_tiny_model

pytest_plugins = ["tests.venvs", "tests.sglang_fixtures", "tests.service_fixtures"]

# --- What a test starts, read from the fixtures it uses (directly or through other fixtures): its markers. ---

STARTS: dict[str, frozenset[str]] = {
    "sglang": frozenset({"sglang_python", "cuda_stub_dir"}),
    "services": frozenset({"redis_server", "redis_factory", "services"}),
    "trainers": frozenset({"trainers_python"}),
    "cli": frozenset({"layertap_cli"}),
}

# --- The fast lane: a bare `pytest` runs only the tests that start nothing (scripts/test.sh runs them all). ---
# A command line that names what to run (a path or node id, -m, -k, --lf) gets exactly that, as pytest's own rules say.

FAST_LANE = " and ".join(f"not {marker}" for marker in STARTS)


def _names_tests(config: pytest.Config) -> bool:
    """Whether the command line chose tests itself: paths or node ids, a marker or keyword expression (even an
    empty ``-m ""``, which is how scripts/test.sh asks for everything), or the last failures."""
    given = config.invocation_params.args
    return (
        config.args_source is pytest.Config.ArgsSource.ARGS
        or bool(config.option.markexpr or config.option.keyword)
        or any(arg.startswith("-m") or arg.startswith("-k") for arg in given)
        or bool(config.getoption("lf", False))
    )


_FAST_LANE_ON = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_FAST_LANE_ON] = not _names_tests(config)
    if config.stash[_FAST_LANE_ON]:
        config.option.markexpr = FAST_LANE


def pytest_report_header(config: pytest.Config) -> str | None:
    if config.stash[_FAST_LANE_ON]:
        return f"fast lane (-m {FAST_LANE!r}): bash scripts/test.sh or pytest -m '' runs everything"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in STARTS.items():
            if used & fixtures:
                item.add_marker(marker)
    items.sort(key=lambda item: _longest_first(_unit(item.nodeid)))  # stable: a module's tests keep their order


# --- What runs together on one pytest-xdist worker (scripts/test.sh's --dist loadfile): a test module, its module
# fixtures built once, and the modules of a group of SHARE_SERVERS together, so one worker starts their CPU servers
# once instead of each worker starting them (a start is 25-100 s on the 2-core box; the suite's summary lists the
# starts by server). xdist's own loadgroup reads an item's `_nodeid`, which pytest 9 no longer reports.

SHARE_SERVERS = {  # each group's modules ask for the same three servers, a worker's share (`live_servers_per_worker`)
    "kimi25-regenerate": (  # the tiny Llama's, the tiny Kimi-K2's and the tiny Kimi-K2.5's
        "tests/core/audit/test_sglang_stores.py",
        "tests/core/regenerate/test_extract_regenerate.py",
        "tests/core/regenerate/test_sglang_regenerate.py",
        "tests/worker/test_regenerate_job.py",
    ),
    "engine-and-plugin": (  # the tiny Llama's, the tiny Kimi-K2's and the tiny Llama's with --keep-radix-cache
        "tests/core/engines/test_sglang_engine.py",
        "tests/sglang_patch/test_server.py",
    ),
}
_GROUP_OF = {module: group for group, modules in SHARE_SERVERS.items() for module in modules}


# Units go to the workers longest first (as measured: tests/durations.json, `scripts/suite_durations.py`), so the run
# ends on short ones on both workers; xdist's own order is by number of tests, whatever they take.
_SECONDS: dict[str, float] = json.loads((Path(__file__).parent / "durations.json").read_text())
_MEDIAN_SECONDS = statistics.median(_SECONDS.values())


def _unit(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return _GROUP_OF.get(module, module)


def _longest_first(unit: str) -> tuple[float, str]:
    """The sort key of a work unit: its modules' measured seconds, descending (a new module counts as the median)."""
    return -sum(_SECONDS.get(m, _MEDIAN_SECONDS) for m in SHARE_SERVERS.get(unit, (unit,))), unit


class ModulesSharingServers(LoadFileScheduling):
    """xdist's loadfile, a group of SHARE_SERVERS one work unit, the units in the collection's order (longest first:
    `pytest_collection_modifyitems`)."""

    def __init__(self, config: pytest.Config, log: object) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # xdist would reorder them by their number of tests

    def _split_scope(self, nodeid: str) -> str:
        return _unit(nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadFileScheduling | None:
    return ModulesSharingServers(config, log) if config.getoption("dist") == "loadfile" else None


# --- Property-based tests: the same examples on every run (a CI failure reproduces), each test sets its budget. ---

settings.register_profile(
    "layertap",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.load_profile("layertap")

# --- The `layertap` command, as a user runs it: in a process of its own (tests that ask for it are marked `cli`). ---


class LayertapCLI:
    """``cli(*args, timeout=600, **run_kwargs)`` runs ``python -m layertap ARGS`` and returns the completed process
    (text, output captured); ``cli.argv`` is the command's prefix, for a test that starts it with ``Popen``."""

    argv = (sys.executable, "-m", "layertap")

    def __call__(self, *args: object, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.argv, *map(str, args)], capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="session")
def layertap_cli() -> LayertapCLI:
    return LayertapCLI()


# --- Tiny models (layertap.tiny): built once per session, treat the folders as read-only. ---


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny Llama (6 layers, hidden 64, float32, seed 0)."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny Kimi-K2-like DeepseekV3 (MLA + MoE, 5 layers, first dense, hidden 64, float32)."""
    return build_tiny_model("kimi-k2", tmp_path_factory.mktemp("tiny-kimi"))


@pytest.fixture(scope="session")
def tiny_kimi25(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny Kimi-K2.5 wrapper (DeepseekV3 as tiny_kimi under `language_model.`, a tiny
    vision tower, tokenizer as code: loading it needs trust_remote_code)."""
    return build_tiny_model("kimi-k2.5", tmp_path_factory.mktemp("tiny-kimi25"))


@pytest.fixture(scope="session")
def tiny_kimi25_int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Kimi-K2.5 wrapper as the real one ships: routed experts compressed-tensors pack-quantized INT4,
    the rest bf16, one shard per decoder layer."""
    return build_tiny_model("kimi-k2.5", tmp_path_factory.mktemp("tiny-kimi25-int4"), quantize="int4")


# --- Independent HF reference: a plain float32 forward with output_hidden_states, batch of one. ---


class HFReference:
    """Reference states for one model: ``states(ids)`` -> (hidden_states tuple of L+1 [T, H], pre-norm final [T, H]).

    The pre-norm final comes from a second copy of the model whose final norm is replaced by the
    identity, so its last ``output_hidden_states`` element is the un-normed residual stream. Nothing
    here shares code with the engines under test.
    """

    def __init__(self, model_dir: Path, dtype=None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        model_dir = _unwrapped(model_dir)
        dtype = dtype or torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.no_norm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.no_norm.get_decoder().norm = torch.nn.Identity()

    def states(self, input_ids):
        import torch

        with torch.no_grad():
            ids = torch.as_tensor(input_ids, dtype=torch.long)[None]
            normed = self.model(ids, output_hidden_states=True).hidden_states
            pre = self.no_norm(ids, output_hidden_states=True).hidden_states[-1]
        return tuple(h[0] for h in normed), pre[0]


def _unwrapped(model_dir: Path) -> Path:
    """A multimodal wrapper's language model as a plain HF folder (its text_config without any quantization as
    config.json, its `language_model.` weights without the prefix, packed INT4 weights dequantized by
    `dequantized_int4`), written beside it; other folders as they are."""
    import json
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    if "text_config" not in config:
        return model_dir
    plain = Path(tempfile.mkdtemp(prefix="unwrapped-"))
    text = {k: v for k, v in config["text_config"].items() if k != "quantization_config"}
    (plain / "config.json").write_text(json.dumps(text))
    weights = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            names = [k for k in f.keys() if k.startswith("language_model.")]  # noqa: SIM118 (safe_open: no __iter__)
            weights.update((k.removeprefix("language_model."), f.get_tensor(k)) for k in names)
    for name in [n for n in weights if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        packed, scale = weights.pop(name), weights.pop(module + ".weight_scale")
        weights[module + ".weight"] = dequantized_int4(packed, scale, weights.pop(module + ".weight_shape").tolist())
    save_file(weights, plain / "model.safetensors", metadata={"format": "pt"})
    return plain


def dequantized_int4(packed, scale, shape):
    """compressed-tensors pack-quantized INT4 as float32, read byte by byte (little-endian words: each byte holds
    the even element in its low nibble, the odd one in its high nibble; each value q + 8), written apart from
    layertap's own dequantizer so that one checks the other."""
    import torch

    out, inp = shape
    octets = packed.contiguous().view(torch.uint8).reshape(out, inp // 2).to(torch.int16)
    nibbles = torch.stack([octets & 0xF, octets >> 4], dim=-1).reshape(out, inp)
    return (nibbles - 8).to(torch.float32) * scale.to(torch.float32).repeat_interleave(inp // scale.shape[1], dim=1)


@pytest.fixture(scope="session")
def hf_reference():
    """``hf_reference(model_dir, dtype=float32)`` -> a cached ``HFReference``."""
    cache: dict[tuple, HFReference] = {}

    def get(model_dir: Path, dtype=None) -> HFReference:
        if (model_dir, dtype) not in cache:
            cache[model_dir, dtype] = HFReference(model_dir, dtype)
        return cache[model_dir, dtype]

    return get
