"""`kvtide plan` against golden outputs, and its argument errors.

The golden files in tests/data/plan are the command's exact output, so any change to
the capacity, decode or DCP model shows up here as a diff. After an intended change,
regenerate them with the command in the assertion message and review the diff.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hf_configs import CONFIGS

from orchestrator.cli.main import main
from placement.devices import DEVICES
from placement.model_catalog import BUILTIN_MODELS, builtin_model_spec

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "plan"

CASES = [
    ("kimi_k2_h200_tp8", "kimi-k2", "h200", "8"),
    ("kimi_k2_gb300_tp16", "kimi-k2", "gb300", "16"),
    ("deepseek_v3_h200_tp8", "deepseek-v3", "h200", "8"),
    ("deepseek_v3_gb300_tp16", "deepseek-v3", "gb300", "16"),
]


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(("golden", "model", "device", "tp"), CASES)
def test_output_matches_the_golden_file(
    capsys: pytest.CaptureFixture[str], golden: str, model: str, device: str, tp: str
) -> None:
    argv = ["--model", model, "--device", device, "--tp", tp, "--context", "131072"]
    code, out, _ = _plan(capsys, *argv, "--users", "64")
    assert code == 0
    expected = (GOLDEN / f"{golden}.txt").read_text()
    regenerate = f"kvtide plan {' '.join(argv)} --users 64 > tests/data/plan/{golden}.txt"
    assert out == expected, f"plan output changed; if intended, regenerate: {regenerate}"


def test_golden_files_say_what_was_asked_on_their_first_line() -> None:
    for golden, model, device, tp in CASES:
        first = (GOLDEN / f"{golden}.txt").read_text().splitlines()[0]
        assert first == (
            f"kvtide plan: {model} on {device}, tp={tp}; context 131,072 tokens, "
            "64 concurrent users"
        )


def test_kimi_k2_on_eight_h200_does_not_fit_and_says_how_many_it_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, out, _ = _plan(capsys, "--model", "kimi-k2", "--device", "h200", "--tp", "8")
    assert out.count("  does not fit\n") == 4  # every DCP degree of TP8
    assert "h200       tp=8 pp=2 (16 GPUs, 2 scale-up domains of 8)" in out
    assert "DCP on h200 tp=8: none, the engine does not fit" in out


def test_every_builtin_model_and_a_config_path_plan_on_several_devices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in BUILTIN_MODELS:
        code, out, _ = _plan(capsys, "--model", name, "--device", "h200,b200", "--context", "8k")
        assert code == 0
        assert "context 8,192 tokens" in out.splitlines()[0]
        assert "\nb200 " in out and "\nh200 " in out
    code, out, _ = _plan(capsys, "--model", str(CONFIGS / "llama3_8b.json"), "--device", "h100-sxm")
    assert code == 0
    assert out.startswith("kvtide plan: llama3_8b on h100-sxm")
    assert "131,072 B/token for the whole model" in out  # the published Llama-3-8B figure


def test_builtin_configs_are_the_published_ones_the_tests_use() -> None:
    import json

    for name, file in BUILTIN_MODELS.items():
        shipped = builtin_model_spec(name)
        tested = json.loads((CONFIGS / file).read_text())
        assert shipped == type(shipped).from_hf_config(tested, name=name)


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--model", "gpt-9", "--device", "h200"], list(BUILTIN_MODELS)),
        (["--model", "kimi-k2", "--device", "h300"], [d.name for d in DEVICES]),
        (["--model", "kimi-k2", "--device", "h200,tpu-v9"], [d.name for d in DEVICES]),
        (["--model", "kimi-k2", "--device", "h200", "--context", "lots"], ["positive integer"]),
        (["--model", "kimi-k2", "--device", "h200", "--users", "0"], ["positive integer"]),
    ],
)
def test_unknown_model_device_or_number_exits_2_naming_the_choices(
    capsys: pytest.CaptureFixture[str], argv: list[str], names: list[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "kvtide plan: error: argument" in err
    for name in names:
        assert name in err


def test_a_tp_the_model_cannot_split_exits_2_naming_the_valid_degrees(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _plan(capsys, "--model", "deepseek-v3", "--device", "h200", "--tp", "3")
    assert code == 2
    assert out == ""
    assert "--tp 3 cannot run deepseek-v3" in err
    assert "valid degrees: 1, 2, 4, 8, 16, 32, 64, 128" in err


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    code, out, _ = _plan(
        capsys, "--model", "deepseek-v3", "--device", "h200", "--tp", "8", "--plot", str(png)
    )
    assert code == 0
    assert out.endswith(f"wrote {png}\n")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_prints_the_table_and_names_the_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes `import matplotlib...` raise ImportError.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    png = tmp_path / "plan.png"
    code, out, err = _plan(capsys, "--model", "kimi-k2", "--device", "gb300", "--plot", str(png))
    assert code == 1
    assert "<- chosen" in out
    assert "`plot` extra" in err and ".[plot]" in err
    assert not png.exists()


def test_pools_print_the_config_the_router_routes_by(capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from orchestrator.config import parse_config
    from orchestrator.router import Router, RouterSettings

    args = ["--model", "deepseek-v3", "--device", "h200", "--context", "64k"]
    args += ["--pools", "2k:0.4,8k:0.3,32k:0.2,128k:0.1", "--sessions-per-s", "5"]
    args += ["--turns", "10", "--output-tokens", "400", "--min-tokens-per-s-per-user", "50"]
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    snippet = out.split("kvtide config:\n", 1)[1]
    data = yaml.safe_load(snippet)
    assert data["decode"]["tensor_parallel_size"] == 8 and "decode_long" in data
    config = parse_config({"device": "cuda", "prefill": {"cpu_threads_bind": None}, **data})
    assert config.decode_long is not None and config.decode_long.decode_context_parallel_size > 1
    threshold = config.routing.long_context_threshold_tokens
    assert threshold is not None and f"above {threshold:,} tokens" in out
    # The router sends exactly the contexts above the threshold to the long pool.
    pool = object()
    router = Router(
        prefill=pool,  # type: ignore[arg-type]
        decode=pool,  # type: ignore[arg-type]
        kv=None,  # type: ignore[arg-type]
        settings=RouterSettings(pull_timeout_s=1.0, long_context_threshold_tokens=threshold),
        decode_long=object(),  # type: ignore[arg-type]
    )
    assert router.decode_pool_for(threshold)[0] == "decode"
    assert router.decode_pool_for(threshold + 1)[0] == "decode_long"


def test_weights_plan_the_checkpoint_stored_at_another_precision(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import dataclasses

    from placement.quantization import stored_as

    # A bf16 release planned as its group-quantized INT4 build: every linear weight at
    # 4 bits plus a 2-byte scale per 64 inputs (4.25 bits); embeddings stay bf16.
    spec = builtin_model_spec("llama3-8b")
    int4 = dataclasses.replace(spec, quant=stored_as("int4", spec.quant))
    assert stored_as("int4", spec.quant).matrix_bytes(4096, 4096) == 4096 * 4096 * 4.25 / 8
    embeddings = 2 * 128_256 * 4_096  # input embeddings and the untied lm_head
    others = spec.num_params - embeddings  # linear weights (and a few norm weights)
    assert int4.weight_bytes() == pytest.approx(others * 4.25 / 8 + 2 * embeddings, rel=1e-3)
    assert int4.weight_bytes() < 0.4 * spec.weight_bytes()

    argv = ["--model", "llama3-8b", "--device", "h200", "--tp", "1", "--context", "8k"]
    code, out, _ = _plan(capsys, *argv, "--weights", "int4")
    assert code == 0
    assert f"{int4.weight_bytes() / 1e9:,.1f} GB of weights (int4-g64)" in out
    code, out, _ = _plan(capsys, *argv)
    assert code == 0 and f"{spec.weight_bytes() / 1e9:,.1f} GB of weights (bf16)" in out
