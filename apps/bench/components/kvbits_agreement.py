"""`kvbank bench kvbits`'s agreement: what quantizing a conversation's KV does to its answers,
kvbank's way and mlx-lm's, over the same tokens.

Many conversations (seeded: a system prompt, a file, the questions in an order of their own),
each of `turns` turns; every prompt is made from the previous turns' full-precision answers,
so every setting answers the same prompts. Per turn, full precision answers greedily (the
reference); each setting then reads the same prompt on its own cache and is fed the
reference's answer (teacher forcing, one forward), which gives its next-token distribution at
every answer position:
- `turns_equal`: its argmax is the reference's token at every position (its greedy answer
  would be the reference's, token for token);
- `token_agreement`: the share of positions whose argmax is the reference's;
- `kl`: KL(reference || setting) of the next-token distributions, per token (nats).

The settings quantize the same history, from the same point:
- `kvbank_N`: kvbank's at-rest quantization (worker/kv/quant.py): a turn restores the
  conversation's history (everything before the restored prefix: its earlier turns)
  dequantized from N bits, and reads and answers the turn in full precision; each token is
  quantized once, when its turn commits;
- `mlx_lm_N`: mlx-lm's QuantizedKVCache with `quantized_kv_start` at the restored prefix (its
  `maybe_quantize_kv_cache`): the history quantized when the second turn starts, as a server
  run with that start does, and every token stored after it quantized as it is stored (the
  turn's own too: mlx-lm has no full-precision turn over a quantized history).
Turn 1 is excluded: nothing is restored yet, so both sides equal full precision by
construction. Intervals (`*_ci95`) are a bootstrap over conversations (turns within one are not
independent), 2,000 resamples, seeded.
"""

from __future__ import annotations

import numpy as np

CHUNK = 512
FILES = ("parse.py", "lexer.c", "server.go", "cache.rs", "router.ts", "store.py", "bank.py",
         "codec.c", "worker.py", "admission.go", "tokenizer.rs", "shim.ts")
QUESTIONS = (
    "Read {f} and list its three bugs.",
    "Fix the first bug in {f} and show the patch.",
    "Now the second one. Keep the patch minimal.",
    "Write a unit test that would have caught the third bug.",
    "Explain why {f} needs a lookahead of two characters.",
    "Rename the main function of {f} everywhere. Which files change?",
    "Summarize the changes so far as a commit message.",
    "What would you refactor next in {f}, and why?",
    "Which error paths in {f} are untested?",
    "Add logging to the slow path of {f}. Show the diff.",
)
SYSTEMS = ("You are a careful coding agent.", "You are a terse senior engineer reviewing code.",
           "You are a coding assistant working in a large repository.",
           "You help fix bugs; answer with patches where you can.")
BOOTSTRAP = 2000


def conversation(rng) -> tuple[str, list[str]]:
    """A seeded conversation's system prompt and questions."""
    f = FILES[rng.integers(len(FILES))]
    order = rng.permutation(len(QUESTIONS))
    return SYSTEMS[rng.integers(len(SYSTEMS))], [QUESTIONS[i].format(f=f) for i in order]


def group_of(lm) -> int:
    """The quantization group kvbank uses for this model's head_dim; mlx-lm's cache gets the
    same."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kvbank.worker.kv import quant

    cache = make_prompt_cache(lm)
    lm(mx.array([[0]]), cache=cache)
    return quant.group_size(int(cache[0].keys.shape[-1]))


class Side:
    """One setting's cache across a conversation's turns (module docstring)."""

    def __init__(self, lm, kind: str, bits: int | None, group: int):
        from kvbank.worker.kv.cache_kinds import CacheKinds

        self.lm, self.kind, self.bits, self.group = lm, kind, bits, group
        self.kinds = CacheKinds.of(lm, bits if kind == "kvbank" else None)
        self.tokens: list[int] = []
        self.cache = None
        self.kept = None  # kvbank: the entry's layers, at rest
        self.quantized_from: int | None = None  # mlx_lm: its quantized_kv_start

    def _cache_at(self, cp: int) -> list:
        """The cache standing at the restored prefix `cp`."""
        from mlx_lm.generate import maybe_quantize_kv_cache

        if self.kind == "kvbank":
            return self.kinds.restore(self.kept, None, cp) if cp else self.kinds.new_cache()
        cache = self.cache if self.cache is not None else self.kinds.new_cache()
        for c in cache:
            c.trim(c.offset - cp)
        if self.kind == "mlx_lm" and cp and self.quantized_from is None:
            self.quantized_from = cp  # quantized_kv_start: the first restored prefix
        if self.kind == "mlx_lm" and self.quantized_from is not None:
            maybe_quantize_kv_cache(cache, self.quantized_from, self.group, self.bits)
        return cache

    def turn(self, prompt: list[int], answer: list[int] | None, max_tokens: int,
             eos: set[int]):
        """The turn on this side's cache: greedy when `answer` is None (the reference), else
        fed `answer`. Returns (the answer, its log-probabilities at each answer position)."""
        import mlx.core as mx

        from kvbank.blocks import common_prefix_len

        cp = min(common_prefix_len(np.asarray(self.tokens, np.uint32),
                                   np.asarray(prompt, np.uint32)), len(prompt) - 1)
        cache = self._cache_at(cp)
        logits = None
        for s in range(cp, len(prompt), CHUNK):
            logits = self.lm(mx.array([prompt[s:s + CHUNK]]), cache=cache)[0, -1]
        if answer is None:
            out, rows = [], []
            while True:
                rows.append(logits)
                token = int(mx.argmax(logits).item())
                out.append(token)
                logits = self.lm(mx.array([[token]]), cache=cache)[0, -1]
                if token in eos or len(out) >= max_tokens:
                    break
            answer, stacked = out, mx.stack(rows)
        else:  # one forward over the answer: its logits at every position after the first
            rest = self.lm(mx.array([answer]), cache=cache)[0, :-1]
            stacked = mx.concatenate([logits[None], rest]) if len(answer) > 1 else logits[None]
        logprobs = stacked.astype(mx.float32) - mx.logsumexp(stacked.astype(mx.float32), axis=-1,
                                                             keepdims=True)
        mx.eval(logprobs)
        self.tokens = prompt + answer
        if self.kind == "kvbank":
            self.kept = self.kinds.full_layers(cache, len(self.tokens), self.kinds.at_rest(cache))
        else:
            self.cache = cache
        return answer, np.array(logprobs)


def _bootstrap(per_conversation: list[list[float]], stat, rng) -> list[float]:
    """95 % interval of `stat` over the scored turns' values, resampling conversations."""
    n = len(per_conversation)
    vals = []
    for _ in range(BOOTSTRAP):
        pick = rng.integers(n, size=n)
        pooled = [v for i in pick for v in per_conversation[i]]
        if pooled:
            vals.append(stat(pooled))
    return [round(float(np.percentile(vals, 2.5)), 4), round(float(np.percentile(vals, 97.5)), 4)]


def agreement(lm, tokenizer, *, conversations: int, turns: int, max_tokens: int,
              seed: int = 0) -> dict:
    eos = set(tokenizer.eos_token_ids)
    group = group_of(lm)
    names = [f"{kind}_{bits}bit" for bits in (8, 4) for kind in ("kvbank", "mlx_lm")]
    # per side, per conversation: the scored turns' values
    equal = {n: [] for n in names}
    agree = {n: [] for n in names}
    kl = {n: [] for n in names}  # per turn: its mean KL per token
    kl_tokens = {n: [] for n in names}  # every scored token's KL
    rng = np.random.default_rng(seed)
    contexts = []
    for _ in range(conversations):
        system, questions = conversation(rng)
        ref = Side(lm, "full", None, group)
        sides = {n: Side(lm, n.split("_")[0] if n.startswith("kvbank") else "mlx_lm",
                         int(n.split("_")[-1][0]), group) for n in names}
        for n in names:
            equal[n].append([]), agree[n].append([]), kl[n].append([])
        messages = [{"role": "system", "content": system}]
        for t in range(turns):
            messages.append({"role": "user", "content": questions[t % len(questions)]})
            prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
            want, ref_lp = ref.turn(prompt, None, max_tokens, eos)
            for n, side in sides.items():
                _, lp = side.turn(prompt, want, max_tokens, eos)
                if t == 0:
                    continue  # nothing restored yet: full precision on both sides
                match = lp.argmax(-1) == np.array(want)
                p = np.exp(ref_lp)
                per_token = (p * (ref_lp - lp)).sum(-1)
                equal[n][-1].append(float(match.all()))
                agree[n][-1].append(float(match.mean()))
                kl[n][-1].append(float(per_token.mean()))
                kl_tokens[n].extend(float(x) for x in per_token)
            text = tokenizer.decode([x for x in want if x not in eos])
            messages.append({"role": "assistant", "content": text})
        contexts.append(len(prompt) + len(want))
    boot = np.random.default_rng(seed + 1)
    mean = lambda v: float(np.mean(v))  # noqa: E731
    out = {}
    for n in names:
        pooled = lambda d: [v for c in d[n] for v in c]  # noqa: E731
        out[n] = {
            "turns_equal": round(mean(pooled(equal)), 4),
            "turns_equal_ci95": _bootstrap(equal[n], mean, boot),
            "token_agreement": round(mean(pooled(agree)), 4),
            "token_agreement_ci95": _bootstrap(agree[n], mean, boot),
            "kl_per_token": round(mean(kl_tokens[n]), 5),
            "kl_per_token_ci95": _bootstrap(kl[n], mean, boot),
            "kl_p95": round(float(np.percentile(kl_tokens[n], 95)), 5),
        }
    return {
        "conversations": conversations, "turns": turns, "max_tokens": max_tokens,
        "scored_turns": conversations * (turns - 1), "scored_tokens": len(kl_tokens[names[0]]),
        "excluded": "turn 1 of each conversation (nothing restored: full precision both sides)",
        "final_context_tokens": {"min": min(contexts), "max": max(contexts)},
        "group_size": group,
        "scope": {
            "kvbank": "the history before the restored prefix, quantized at rest (dequantized "
                      "to restore); the turn read and answered in full precision",
            "mlx_lm": "QuantizedKVCache from quantized_kv_start = the restored prefix of turn "
                      "2: the history, and every token stored after it, the turn's own too"},
        "sides": out,
    }
