"""The tiny models coding agents run on in tests and in `kvbank bench agents`.

A random model knows no tool format and never stops: `with_tools_template` gives the tiny
llama a Qwen-style tools template (kvbank/testing/templates/qwen_tools.jinja), so mlx-lm gives it a
tool parser and the worker can force calls; `says_done` makes its head answer "Done" and end
at any temperature, so real agent CLIs (which sample at their own temperature and give up on
an answer that never ends) finish every turn; `calls_once` makes it call a tool first, so
that a CLI, which sends no tool_choice, runs a real tool loop. All of it is deterministic: one seed, one folder,
byte for byte, so a recording made on one machine replays on another.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOOLS_TEMPLATE = Path(__file__).parent / "templates" / "qwen_tools.jinja"
CONTEXT = 65536  # Claude Code's system prompt and tools are about 21K tokens


def with_tools_template(src: Path, out: Path) -> Path:
    """`src` with the tools chat template (the default model's template has none)."""
    shutil.copytree(src, out)
    template = TOOLS_TEMPLATE.read_text()
    (out / "chat_template.jinja").write_text(template)
    config = json.loads((out / "tokenizer_config.json").read_text())
    if "chat_template" in config:
        config["chat_template"] = template
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _widened(src: Path, out: Path, context: int) -> tuple[dict, dict, dict]:
    """A copy of `src` with a `context`-token context and an untied head: (config, weights
    as numpy arrays, vocabulary)."""
    import mlx.core as mx
    import numpy as np

    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config.update(max_position_embeddings=context, tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config))
    tok = json.loads((out / "tokenizer_config.json").read_text())
    tok["model_max_length"] = context
    (out / "tokenizer_config.json").write_text(json.dumps(tok))
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    w = {k: np.array(v) for k, v in mx.load(str(out / "model.safetensors")).items()}
    return config, w, vocab


def _save(out: Path, w: dict) -> Path:
    import mlx.core as mx

    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in w.items()},
                        metadata={"format": "mlx"})
    return out


def says_done(src: Path, out: Path, context: int = CONTEXT) -> Path:
    """`src` with a `context`-token context and a head that answers "Done" and ends, whatever
    the temperature: one direction of every embedding is constant and the head's "Done" row
    reads it; a second is set in "Done"'s embedding alone, and the end-of-turn row reads it
    twice as hard. After any token the model writes "Done"; after "Done", the end."""
    import numpy as np

    config, w, vocab = _widened(src, out, context)
    done = vocab["Done"]
    embed = w["model.embed_tokens.weight"]
    embed[:, :2] = 0.0
    embed[:, 0] = 1.0
    embed[done, 1] = 1.0
    head = np.zeros_like(embed)
    scale = np.sqrt(embed.shape[1])  # what RMSNorm leaves of a unit direction
    head[done, 0] = 40.0 * scale
    head[config["eos_token_id"], 1] = 80.0 * scale
    w["lm_head.weight"] = head
    return _save(out, w)


def _resolve(seq: list[int], start: int) -> tuple[list, list]:
    """The rules that write `seq` after `start` and then end: (cur, next, feature) where
    feature is None or an index into the returned features [(offset, token)]: where a token
    recurs with another next token, the token `offset` places back tells them apart."""
    full = [start, *seq, -1]  # -1: the end of the answer
    feats: list[tuple[int, int]] = []
    rules = []
    for cur in dict.fromkeys(full[:-1]):
        at = [j for j, t in enumerate(full[:-1]) if t == cur]
        nexts = {full[j + 1] for j in at}
        if len(nexts) == 1:
            rules.append((cur, full[at[0] + 1], None))
            continue
        for k in range(1, 8 if len(nexts) == 2 else 1):  # a token k back before one next only
            back = {j: full[j - k] if j >= k else None for j in at}
            pick = next((j for j in at if back[j] is not None and all(
                back[i] != back[j] for i in at if full[i + 1] != full[j + 1])), None)
            if pick is not None:
                feats.append((k, back[pick]))
                rules.append((cur, full[pick + 1], len(feats) - 1))
                other = next(full[j + 1] for j in at if full[j + 1] != full[pick + 1])
                rules.append((cur, other, None))
                break
        else:
            raise ValueError(f"token {cur} cannot be told apart in {seq}")
    return rules, feats


def calls_once(src: Path, out: Path, call: str, context: int = CONTEXT) -> Path:
    """`src` made to call the tool `call` (with no arguments) when the user asks, then answer
    "Done" when the tool's output comes back, whatever the temperature: a real tool loop for
    agent CLIs, which choose their tools themselves (no tool_choice to force one).

    The head reads the current token's own direction (each token of the call has one) and
    features that layer 0's attention writes: each of its heads looks a fixed number of tokens
    back (RoPE: the query is the key turned back by that many positions) and reports whether a
    given token stands there. Whether "response" stands 7 tokens back (`</tool_response>` just
    before the assistant's header) decides between calling and "Done"; the call's recurring
    tokens (`>`, `_`) are told apart the same way. The call is written compactly
    (`<tool_call>{"name":"X","arguments":{}}</tool_call>`); the template renders it back
    spaced out, and the router's answer splice puts the generated tokens back in its place."""
    import numpy as np
    from tokenizers import Tokenizer

    config, w, vocab = _widened(src, out, context)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    seq = ids('<tool_call>{"name":"%s","arguments":{}}</tool_call>' % call)
    newline, done, eos = ids("\n")[0], vocab["Done"], config["eos_token_id"]
    response = ids("</tool_response>")[3]
    rules, feats = _resolve(seq, newline)
    rules = [r for r in rules if r[0] != newline] + [(newline, seq[0], None)]
    feats.append((7, response))  # after a tool's output, "Done"
    rules += [(newline, done, len(feats) - 1), (done, eos, None)]
    heads, hd = config["num_attention_heads"], config["head_dim"]
    if len(feats) > heads:
        raise ValueError(f"{call}: {len(feats)} features, {heads} heads")
    own = list(dict.fromkeys([newline, done, *seq, *(t for _, t in feats)]))
    const, filler, first_feat, first_own = 0, 1, 2, 2 + heads
    dim = {t: first_own + i for i, t in enumerate(own)}
    embed = w["model.embed_tokens.weight"]
    embed[:, :first_own + len(own)] = 0.0
    embed[:, const] = embed[:, filler] = 1.0
    for t, d in dim.items():
        embed[t, filler], embed[t, d] = 0.0, 1.0
    norm = np.sqrt(embed.shape[1] / np.mean(np.sum(embed[:1000] ** 2, axis=1)))
    # layer 0: head h looks feats[h][0] tokens back and reads whether feats[h][1] is there
    a, half = 4.0, hd // 2
    freq = config.get("rope_theta", 10000.0) ** (-np.arange(half) / half)
    q, k = np.zeros_like(w["model.layers.0.self_attn.q_proj.weight"]), \
        np.zeros_like(w["model.layers.0.self_attn.k_proj.weight"])
    v, o = np.zeros_like(w["model.layers.0.self_attn.v_proj.weight"]), \
        np.zeros_like(w["model.layers.0.self_attn.o_proj.weight"])
    for g in range(config["num_key_value_heads"]):
        k[g * hd:g * hd + half, const] = a
        for h, (_, token) in enumerate(feats):
            v[g * hd + h, dim[token]] = 1.0
    for h, (back, _) in enumerate(feats):
        q[h * hd:h * hd + half, const] = a * np.cos(back * freq)
        q[h * hd + half:(h + 1) * hd, const] = -a * np.sin(back * freq)
        o[first_feat + h, h * hd + h] = 1.0 / norm
    w.update({"model.layers.0.self_attn.q_proj.weight": q,
              "model.layers.0.self_attn.k_proj.weight": k,
              "model.layers.0.self_attn.v_proj.weight": v,
              "model.layers.0.self_attn.o_proj.weight": o})
    head = np.zeros_like(embed)
    big = 100.0 * norm
    head[done, const] = 40.0 * norm  # after anything else, "Done"
    for cur, nxt, feat in rules:
        nxt = eos if nxt == -1 else nxt
        if feat is None:
            head[nxt, dim[cur]] += big
        else:  # the marked next token; the other one loses what this one gains
            head[nxt, first_feat + feat] += 0.8 * big
            other = [n for c, n, f in rules if c == cur and f is None]
            for n in other:
                head[eos if n == -1 else n, first_feat + feat] -= 2 * big
    w["lm_head.weight"] = head
    return _save(out, w)


def agent_model(root: Path, cache_dir: Path | None = None, seed: int = 0,
                call: str | None = None) -> Path:
    """The model an agent recording was made on, built under `root` (which must not hold one
    yet): the tiny llama of `seed`, the tools template, and a head that calls `call` once
    per user turn and then answers "Done" (`calls_once`), or, without `call`, answers "Done"
    at once (`says_done`)."""
    from kvbank.testing.tiny import make_tiny_model

    tiny = make_tiny_model(Path(root) / "tiny", seed=seed, cache_dir=cache_dir)
    tools = with_tools_template(tiny, Path(root) / "tools")
    if call:
        return calls_once(tools, Path(root) / "model", call)
    return says_done(tools, Path(root) / "model")
