"""vLLM's sampling parameters for a ``GenerateRequest``, and its log probabilities as
kvtide's wire types. Imported by the vLLM adapter only (vLLM is imported inside the
functions that need it).

A request carries vLLM's own ``SamplingParams`` when vLLM's OpenAI serving layer made
them (``GenerateRequest.sampling_params``): the engine samples by them as vLLM's own
server would, with three things kvtide sets for the P/D path: the token budget (a
prefill makes one token, a migrated decode what is left), one choice per request, and
the KV transfer parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from engines.base import GenerateRequest, TokenLogprob

__all__ = [
    "logprobs_of",
    "prompt_logprobs_of",
    "sampling_args_for",
    "sampling_params_for",
]


def sampling_args_for(request: GenerateRequest) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``SamplingParams`` for ``request`` (pure; tested)."""
    sampling = request.sampling
    return {
        "max_tokens": request.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "seed": sampling.seed,
        "stop": list(sampling.stop) or None,
        "ignore_eos": sampling.ignore_eos,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        # vLLM refuses min_tokens > max_tokens; a turn's prefill asks for one token.
        "min_tokens": min(sampling.min_tokens, request.max_tokens),
        "prompt_logprobs": request.prompt_logprobs,
        "logprobs": request.logprobs,
        "extra_args": _extra_args(request, None),
    }


def _extra_args(request: GenerateRequest, given: Mapping[str, Any] | None) -> dict[str, Any] | None:
    args = dict(given or {})
    args.pop("kv_transfer_params", None)  # kvtide's alone: the router sets them
    if request.kv_transfer_params is not None:
        args["kv_transfer_params"] = request.kv_transfer_params.to_vllm()
    return args or None


def sampling_params_for(request: GenerateRequest, output_kind: Any) -> Any:
    """vLLM's ``SamplingParams`` for ``request``: the serving layer's own, with the
    token budget, one choice and the KV transfer set; or made from the request's fields."""
    from vllm import SamplingParams

    given = request.sampling_params
    if given is None:
        return SamplingParams(**sampling_args_for(request), output_kind=output_kind)
    params = given.clone()
    params.n = 1
    params.max_tokens = request.max_tokens
    params.min_tokens = min(params.min_tokens, request.max_tokens)
    params.output_kind = output_kind
    params.extra_args = _extra_args(request, params.extra_args)
    # The prefill computes the prompt's; a decode's prompt KV is pulled, not computed.
    params.prompt_logprobs = request.prompt_logprobs
    if params.logprobs is None:
        params.logprobs = request.logprobs
    return params


def _position(candidates: Mapping[int, Any]) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            token_id=int(token_id),
            logprob=float(lp.logprob),
            rank=None if lp.rank is None else int(lp.rank),
            decoded=lp.decoded_token,
        )
        for token_id, lp in candidates.items()
    ]


def logprobs_of(positions: Iterable[Mapping[int, Any]] | None) -> list[list[TokenLogprob]] | None:
    """vLLM's sample log probabilities (a list, or its flat form), one list a token."""
    if positions is None:
        return None
    return [_position(candidates) for candidates in positions]


def prompt_logprobs_of(
    positions: Iterable[Mapping[int, Any] | None] | None,
) -> list[list[TokenLogprob] | None] | None:
    """vLLM's prompt log probabilities (None at the first position)."""
    if positions is None:
        return None
    return [None if c is None else _position(c) for c in positions]
