"""A tiny qwen3_5 with an MTP head that drafts well: its head trained by self-distillation.

A random trunk's greedy text is chaotic (48 distinct tokens in 48, at either size), and no
head can predict it; real text is predictable between surprises. So this trunk's token
embeddings are set, not drawn: sinusoids of the token id (E[v] = A (cos v w_f, sin v w_f),
w_f seeded), with an LM head shifted by one row (row v = E[v-1], scaled so logits span about
LOGITS). A hidden state near E[x] then scores x+1 highest, and the greedy text runs through
consecutive ids until the context (the Gated DeltaNet and attention layers, drawn as
kvbank/testing/tiny.py draws them) pushes it elsewhere: at amplitude A about one step in six or seven
jumps, at either size, and where depends on every cache, so a cache restored or rolled back
wrong changes the text.

The head is then trained with the trunk frozen, by self-distillation: on sequences of random
prompts and the trunk's own greedy continuations, the pair (h_i, token i+1) is fed exactly as
decoding feeds it, and the head's output is scored by the trunk's LM head against the trunk's
token i+2 (cross-entropy over that token and NEGATIVES random rows: the full vocabulary would
cost a trunk forward a step) and pulled towards the trunk's hidden h_{i+1} (which chained
drafts read). Training starts from a head whose residual branches add nothing (zero output
projections, as residual blocks are often started) and whose fc passes the next token's
embedding through, and keeps the parameters that agree best with the trunk on held-out
continuations (a quarter of them): a head trained from mlx's random init on so few
sequences learns them by heart (train 0.88, held-out 0.02 at the default size). The folder
records how it went (kvbank_mtp_training.json). Seeded: one seed gives the same folder.

    python -m kvbank.testing.tiny_mtp OUT_DIR [--size tiny|default] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from kvbank.models import atomic_dir, default_cache_dir, default_model_dir, locked
from kvbank.testing.tiny import TEMPLATE_PATH, _write_tokenizer, arch_config, build_model

AMPLITUDE = {"tiny": 1.6, "default": 1.3}  # the embeddings' scale: jumps at ~1 step in 7
LOGITS = 20.0  # the LM head's scale: a hidden state on a row scores about this much
# Training: sequences of a random prompt and the trunk's greedy continuation, a quarter of
# them held out; steps of `batch` sequences.
TRAIN = {"tiny": dict(sequences=64, prompt=8, generate=32, steps=100, batch=8),
         "default": dict(sequences=32, prompt=8, generate=24, steps=100, batch=4)}
LEARNING_RATE = 3e-3
NEGATIVES = 256  # random rows of the LM head each step scores against the trunk's token
MSE_WEIGHT = 0.1  # keeps g near the trunk's hidden, which chained drafts read as one
EVAL_EVERY = 25
TRAINING_FILE = "kvbank_mtp_training.json"  # the folder's record of how its head was trained
RECIPE = 1  # bump when what make_mtp_model writes changes: cached folders are rebuilt


def counting_embeddings(vocab: int, hidden: int, amplitude: float, seed: int):
    """(embed_tokens, lm_head) as numpy: sinusoids of the token id, the head shifted by one
    row and scaled so that logits span about LOGITS, as a trained model's do (the verify's
    matmul shapes move a logit by a relative ~1e-6: at hundreds, that would be 1e-4)."""
    rng = np.random.default_rng(seed + 7)
    omega = rng.uniform(0.0, np.pi, hidden // 2)
    angle = np.arange(vocab)[:, None] * omega[None, :]
    unit = np.empty((vocab, hidden), np.float32)
    unit[:, 0::2], unit[:, 1::2] = np.cos(angle), np.sin(angle)  # rows of norm sqrt(hidden/2)
    lm_head = np.roll(unit, 1, axis=0) * np.float32(LOGITS * 2**0.5 / hidden)
    return unit * np.float32(amplitude), lm_head


def _continuations(model, vocab: int, rng, *, sequences: int, prompt: int, generate: int):
    """Random prompts and the trunk's greedy continuations, [sequences, prompt + generate]."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.array(rng.integers(0, vocab, (sequences, prompt)))
    cache = make_prompt_cache(model)
    y = mx.argmax(model(tokens, cache=cache)[:, -1:], axis=-1)
    out = [tokens]
    for _ in range(generate):
        out.append(y)
        y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        mx.eval(y)
    return mx.concatenate(out, axis=1)


def _passing_head(trunk):
    """A head whose layer adds nothing yet (its output projections zero: a residual block
    starts as the identity) and whose fc passes the next token's embedding through: it
    drafts "the trunk's next hidden is near this token's embedding"."""
    import mlx.core as mx

    from kvbank.mtp_head import make_head

    head = make_head(trunk)
    layer, d = head.layers[0], trunk.args.hidden_size
    layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    head.fc.weight = mx.concatenate([mx.eye(d), mx.zeros((d, d))], axis=1)
    mx.eval(head.parameters())
    return head


def train_head(model, seed: int, *, sequences: int, prompt: int, generate: int, steps: int,
               batch: int, lr: float = LEARNING_RATE, log=print):
    """Self-distillation of a head for `model` (frozen), kept at its best agreement with the
    trunk on held-out continuations; returns (head, report)."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten, tree_map

    from kvbank.mtp_head import Trunk

    trunk = Trunk(model)
    rng = np.random.default_rng(seed + 11)
    t0 = time.monotonic()
    seq = _continuations(model, trunk.args.vocab_size, rng, sequences=sequences, prompt=prompt,
                         generate=generate)
    hidden = mx.concatenate([trunk.hidden(seq[i:i + 16], None) for i in range(0, sequences, 16)])
    embed = trunk.embed(seq)
    target = mx.argmax(trunk.logits(hidden[:, 1:]), axis=-1)  # the trunk's token i+2
    mx.eval(hidden, embed, target)
    held = sequences // 4
    train, test = slice(held, sequences), slice(0, held)
    lm_head = trunk.logits(mx.eye(trunk.args.hidden_size)).T  # [V, H]: rows score hidden
    log(f"data: {sequences} sequences of {seq.shape[1]} tokens in {time.monotonic() - t0:.1f}s")

    def agreement(head) -> float:
        """Share of held-out continuation tokens the head drafts as the trunk's."""
        g = head(hidden[test, :-1], embed[test, 1:], None)
        drafted = mx.argmax(trunk.logits(g), axis=-1)
        return (drafted[:, prompt:] == target[test, prompt:]).mean().item()

    head = _passing_head(trunk)
    best = (agreement(head), 0, tree_map(lambda x: x, head.parameters()))
    report = {"held_out_at_start": round(best[0], 4)}
    n_train = sequences - held
    step = nn.value_and_grad(head, _loss(lm_head))
    opt = optim.Adam(learning_rate=lr)
    t0 = time.monotonic()
    for i in range(1, steps + 1):
        idx = mx.array(held + rng.choice(n_train, batch, replace=False))
        value, grads = step(head, hidden[idx, :-1], embed[idx, 1:], target[idx], hidden[idx, 1:],
                            mx.array(rng.integers(0, trunk.args.vocab_size, NEGATIVES)))
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, value)
        if i % EVAL_EVERY == 0 or i == steps:
            a = agreement(head)
            log(f"step {i}: loss {value.item():.4f}, held-out agreement {a:.3f} "
                f"({time.monotonic() - t0:.1f}s)")
            if a > best[0]:
                best = (a, i, tree_map(lambda x: x, head.parameters()))
    head.update(best[2])
    head.eval()
    report.update(held_out=round(best[0], 4), step=best[1],
                  tensors=len(tree_flatten(head.parameters())))
    return head, report


def _loss(lm_head):
    """Cross-entropy of the trunk's token against it and NEGATIVES random rows of the LM
    head (the full vocabulary would cost a trunk forward a step), plus MSE_WEIGHT times the
    distance to the trunk's next hidden."""
    import mlx.core as mx

    def loss(head, h, e, tok, h_next, negatives):
        g = head(h, e, None)
        rows = mx.concatenate([tok[..., None],
                               mx.broadcast_to(negatives, tok.shape + negatives.shape)], axis=-1)
        logits = (lm_head[rows] @ g[..., None])[..., 0]
        ce = (mx.logsumexp(logits, axis=-1) - logits[..., 0]).mean()
        return ce + MSE_WEIGHT * ((g - h_next) ** 2).mean()

    return loss


def make_mtp_model(out_dir: Path, *, size: str = "tiny", seed: int = 0, context: int = 8192,
                   cache_dir: Path | None = None, log=print) -> Path:
    """Write the counting qwen3_5 with its trained MTP head at out_dir (module docstring)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out_dir = Path(out_dir)
    tok_dir = default_model_dir(cache_dir)
    src = json.loads((tok_dir / "config.json").read_text())
    with locked(out_dir), atomic_dir(out_dir) as tmp:
        vocab = _write_tokenizer(tok_dir, tmp, think_tokens=True,
                                 template=TEMPLATE_PATH.read_text(), context=context)
        config = arch_config("qwen3_5", size=size, vocab=vocab, context=context)
        config.update({k: src[k] for k in ("bos_token_id", "eos_token_id") if k in src})
        config["tie_word_embeddings"] = False
        model, weights = build_model(config, seed)
        embed, lm_head = counting_embeddings(vocab, config["hidden_size"], AMPLITUDE[size], seed)
        weights["language_model.model.embed_tokens.weight"] = mx.array(embed)
        weights["language_model.lm_head.weight"] = mx.array(lm_head)
        model.load_weights([(k, weights[k]) for k in ("language_model.model.embed_tokens.weight",
                                                      "language_model.lm_head.weight")],
                           strict=False)
        head, report = train_head(model, seed, **TRAIN[size], log=log)
        (tmp / TRAINING_FILE).write_text(json.dumps({"size": size, "seed": seed, **TRAIN[size],
                                                     **report}, indent=2) + "\n")
        weights.update({f"mtp.{k}": v for k, v in tree_flatten(head.parameters())})
        config["mtp_num_hidden_layers"] = 1
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def mtp_model(size: str = "tiny", cache_dir: Path | None = None, seed: int = 0) -> Path:
    """The trained-head model of `size`, built once into kvbank's cache dir, in a child
    process (the caller holds no MLX), as kvbank.testing.tiny.bench_model does."""
    import subprocess
    import sys

    out = (cache_dir or default_cache_dir()) / "bench-models" / f"qwen3_5-{size}-mtp{RECIPE}-{seed}"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "kvbank.testing.tiny_mtp", str(out), "--size", size,
                        "--seed", str(seed)], check=True, stdout=subprocess.DEVNULL)
    return out


def main(argv: list[str] | None = None) -> None:
    from kvbank.config import preload_openblas

    p = argparse.ArgumentParser(prog="python -m kvbank.testing.tiny_mtp", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--size", choices=tuple(AMPLITUDE), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    preload_openblas()
    print(make_mtp_model(args.out_dir, size=args.size, seed=args.seed))


if __name__ == "__main__":
    main()
