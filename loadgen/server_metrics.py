"""Counters read from the server's Prometheus `/metrics` around a run, when it exposes them: speculative
decoding's draft and accepted tokens (hetserve's and vLLM's names)."""
from __future__ import annotations

import httpx

SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
PREFIXES = ("hetserve:", "vllm:")


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text -> {counter name without prefix and `_total`: value summed over its labels} for
    SPEC_COUNTERS."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{")[0]
        for prefix in PREFIXES:
            if name.startswith(prefix):
                key = name[len(prefix):].removesuffix("_total")
                if key in SPEC_COUNTERS:
                    out[key] = out.get(key, 0.0) + float(value)
    return out


def read_counters(base_url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's speculative decoding counters now; {} when it has no /metrics or none of them."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=5)
    except httpx.HTTPError:
        return {}
    return parse_counters(r.text) if r.status_code == 200 else {}


def speculation_summary(before: dict[str, float], after: dict[str, float]) -> dict:
    """The run's speculative decoding figures from counters read before and after it: draft tokens, their
    acceptance rate and the mean acceptance length (tokens a speculating step emits per sequence); {} when the
    server sent no drafts during the run."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    drafts, sent, accepted = (delta[k] for k in SPEC_COUNTERS)
    if sent <= 0:
        return {}
    return {"spec_decode_draft_tokens": int(sent), "spec_decode_accepted_tokens": int(accepted),
            "spec_decode_acceptance_rate": accepted / sent,
            "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else None}
