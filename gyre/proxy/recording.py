"""Recording a finished generation into its execution's tree, and its OpenAI answer.

The capture's last hop: the sampled ids become the call's node (gyre.proxy.capture.record_call),
the request's messages the start of the next call's walk (capture.remember), the journal and the
routed experts get theirs, and the harness gets OpenAI's response (JSON shape; the streaming relay,
gyre.proxy.relay, sends the same pieces as chunks). Functions of the `Proxy` (gyre.proxy.server)
whose state they read and count into; it calls them through its methods of the same names.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Any

from gyre.model.parsers import parse
from gyre.proxy.call import AbortedCall, Call
from gyre.proxy.capture import ExecutionSession, record_call, remember
from gyre.proxy.chat import Message, ParsedOutput, ToolCall, canonical_arguments, parse_output, strip_end_tokens
from gyre.proxy.params import RequestError
from gyre.proxy.sampling import count_call
from gyre.traj.routing import record_call_routing

log = logging.getLogger("gyre.proxy")


def finish(proxy, c: Call, res) -> tuple[dict, Any]:
    """Record a finished generation and build the OpenAI response (non-streamed shape)."""
    sess, p = c.sess, c.params
    if sess.ended:  # the execution ended while its call ran (its generation was aborted): not recorded
        proxy.abandoned["execution_ended"] += 1
        raise RequestError(409, "execution ended while the call was running", "invalid_request_error",
                           "execution_ended")
    if res.finish_reason == "abort":
        proxy.abandoned["aborted"] += 1
        raise AbortedCall(res.finish_message or "generation aborted")
    out_ids, lps = list(res.output_ids), list(res.logprobs)
    text = proxy.renderer.decode_output(c.forced + out_ids)
    matched_stop = res.finish_reason == "stop" and isinstance(res.meta_info.get("finish_reason", {}).get("matched"), str)
    hits = [text.find(s) for s in c.engine_params.get("stop", ()) if s in text]
    if hits:
        text = text[: min(hits)]
    tools_on = bool(c.tools) and p.tool_choice != "none"
    reasoning = None
    if proxy.template is not None:  # parsers by name (gyre.model.parsers)
        parsed, reasoning = parse_named(proxy, text, tools_on)
    else:
        parsed = parse_output(text, tools_enabled=tools_on)
    reply = Message("assistant", parsed.content or "", tuple(parsed.tool_calls), reasoning or "")
    prepared = c.prepared
    if c.forced:  # forced ids are context the model saw, not samples
        prepared = dataclasses.replace(prepared, prompt_tokens=prepared.prompt_tokens + c.forced,
                                       n_input=prepared.n_input + len(c.forced))
    call = record_call(sess, prepared, reply, out_ids, lps, agent_role=c.role,
                       weight_version=str(res.weight_version), endpoint=res.endpoint,
                       finish_reason=res.finish_reason, t_start=c.t0, replay_ids=c.forced + out_ids,
                       sampling=c.engine_params)
    proxy.sampling_changed += count_call(sess, p, len(out_ids), proxy.token_budget)
    remember(sess, prepared, *c.walk, proxy.renderer.im_end, prepared.dicts)
    if proxy.journal is not None and c.wire is not None:  # durable past a SIGKILL before the harness hears
        proxy.journal.append(sess.record.execution_id, c.wire, out_ids, lps, res.finish_reason,
                            str(res.weight_version))
    if proxy.routing is not None:
        record_routing(proxy, sess, call, res)
    proxy.calls_total += 1
    if parsed.tool_calls:
        finish = "tool_calls"
    elif res.finish_reason == "length" and not matched_stop and not hits:
        finish = "length"
    else:
        finish = "stop"
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if parsed.tool_calls:
        msg["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
                              "function": {"name": t.name, "arguments": t.arguments}} for t in parsed.tool_calls]
    n_in = prepared.n_input
    resp = {
        "id": c.id, "object": "chat.completion", "created": int(c.t0),
        "model": c.body.get("model") or proxy.model_name,
        "choices": [{"index": 0, "message": msg, "finish_reason": finish,
                     "logprobs": logprobs(proxy, out_ids, res) if p.logprobs else None}],
        "usage": {"prompt_tokens": n_in, "completion_tokens": len(out_ids), "total_tokens": n_in + len(out_ids)},
        "gyre": {"call_index": call.index, "weight_version": call.weight_version, "reused_messages": prepared.n_reused,
                 # what the engine sampled with (stored with the call) and, where the policy changed
                 # it, what the harness asked for
                 "sampling": {"temperature": p.temperature, "top_p": p.top_p,
                              **({"requested": p.requested} if p.requested else {})}},
    }
    return resp, parsed


def record_routing(proxy, sess: ExecutionSession, call, res) -> None:
    """The call's routed experts into its tree; a call answered without them (an engine not
    started with --enable-return-routed-experts) trains with free routing, counted and warned."""
    b64 = res.meta_info.get("routed_experts")
    if b64:
        try:
            record_call_routing(sess.tree, call, b64, proxy.routing)
            return
        except ValueError as e:
            log.warning("call %d of %s: routed experts not stored: %s", call.index,
                        sess.record.execution_id, e)
    elif not proxy.routing_missing:
        log.warning("train.routing_replay: the engine answered without routed experts (SGLang needs "
                    "--enable-return-routed-experts); such calls train with free routing")
    proxy.routing_missing += 1


def parse_named(proxy, text: str, tools_on: bool):
    """The configured tool-call and reasoning parsers, as the built-in path's ParsedOutput."""

    out = parse(strip_end_tokens(text), proxy.tool_parser, proxy.reasoning_parser, tools_enabled=tools_on)
    calls = [ToolCall(t.name, canonical_arguments(t.arguments, "output")) for t in out.tool_calls]
    return ParsedOutput(out.content, calls), out.reasoning_content


def logprobs(proxy, out_ids: list[int], res) -> dict:
    """OpenAI's ``logprobs.content``: every sampled token but a final end token, with the
    log-prob of the distribution it was drawn from (the one training uses)."""
    stop = set(proxy.renderer.stop_ids())
    n = len(out_ids) - (1 if out_ids and out_ids[-1] in stop else 0)
    return {"content": logprob_entries(proxy, out_ids, res, 0, n), "refusal": None}


def logprob_entries(proxy, out_ids: list[int], res, start: int, stop: int) -> list[dict]:
    """The `logprobs.content` entries of tokens [start, stop): a streamed chunk carries those
    of its own tokens (as OpenAI and SGLang stream them), so each is built once."""
    def entry(tid: int, lp: float) -> dict:
        tok = proxy.renderer.decode([tid])
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8", "surrogatepass"))}

    content = []
    for k in range(start, stop):
        e = entry(out_ids[k], res.logprobs[k])
        tops = res.top_logprobs[k] if k < len(res.top_logprobs) else []
        e["top_logprobs"] = [entry(t, lp) for lp, t in tops]
        content.append(e)
    return content

