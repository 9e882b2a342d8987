"""Tiny models of the model families coding agents run, each with its family's published chat
template (kvbank/testing/templates/families/, where each came from in SOURCES.md there), for tests and
`kvbank bench agents --template FAMILY`.

`family_model(out, family)` is the family's architecture at tiny size with random weights and
SmolLM2's tokenizer plus the family's own tokens. Random weights never write a tool call, so
`scripted_model(out, family)` is the same architecture with weights set so that after the
family's generation prompt it writes what a model of that family writes: a line of reasoning
(for a family that reasons), then `run(cmd="ls", background=false)` in the family's own call
format, then the family's stop token; and, where the call is ruled out (tool_choice none masks
its first token), "Done." instead. Every turn of a tool loop therefore calls `run` again.

How the weights write it, whatever the architecture:
- Each token the script uses (and the few before it in the generation prompt) has a code
  direction of its own in the embeddings; every other token shares one.
- One attention layer of the architecture is set so that two of its heads copy the code of
  the token 1 back and two the code of the token 2 back into directions of their own (RoPE:
  each query is the key turned back by that many positions; values carry the codes). SmolLM2
  spells a lone newline one way only, so the script's many "\\n" are told apart by what stands
  before them. nemotron_h's attention has no positions: its script needs no look-back.
- The text is spelled with tokens chosen so that the three codes (this token, the one before,
  the one before that) decide the next token (`spell`): the spelling is rarely the one the
  tokenizer would choose, so every answer exercises the router's answer splice.
- Every other block's output is scaled down to `BLOCKS` of its random value: the blocks still
  read the whole context (a wrong KV restore changes the log-probabilities) but never the
  argmax. lm_head is fitted on the hidden states of real rendered prompts (a margin
  perceptron over the script's next-token choices), then the folder is checked by decoding
  prompts it was not fitted on.

Deterministic: one family, one folder, byte for byte.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates" / "families"
CONTEXT = 16384
LOOK_BACK = 4   # tokens before the current one that decide the next (one attention head each)
MAMBA_LOOK_BACK = 3
_VOCAB_MATRICES = ("embed_tokens.weight", "embeddings.weight", "lm_head.weight")
_DEBUG = False  # what a Mamba-2 mixer's convolution (kernel 4) reads
BLOCKS = 0.05    # what is left of each block's output in a scripted model
MARGIN = 12.0    # logit margin of the scripted next token over every other (and of "Done"
                 # over the rest where the call is masked)

# The two tools every family's scripted loop offers, and the call its model writes.
TOOLS = [
    {"type": "function", "function": {
        "name": "run", "description": "Run a shell command in the repository.",
        "parameters": {"type": "object", "required": ["cmd", "background"], "properties": {
            "cmd": {"type": "string", "description": "The command line."},
            "background": {"type": "boolean", "description": "Run it in the background."}}}}},
    {"type": "function", "function": {
        "name": "read", "description": "Read a file.",
        "parameters": {"type": "object", "required": ["path"], "properties": {
            "path": {"type": "string", "description": "The file's path."}}}}},
]
CALL = ("run", {"cmd": "ls", "background": False})
REASONING = "Let me list the files."
FINAL = "Done."


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    template: str           # file in kvbank/testing/templates/families
    arch: str               # mlx-lm model_type of its tiny models
    special: tuple[str, ...]  # its tokens SmolLM2 lacks
    eos: tuple[str, ...]    # its stop tokens
    reasoning: str          # what its model writes after the generation prompt, before...
    call: str               # ...the call of CALL and the stop token, or...
    final: str              # ...the final answer FINAL and the stop token (call masked)
    bos: str | None = None
    think_tokens: bool = False  # <think> / </think> (mlx-lm reads reasoning by them)
    overrides: tuple = ()   # config fields of the scripted model

    @property
    def template_text(self) -> str:
        return (TEMPLATES / self.template).read_text()


_QWEN = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_QWEN_CALL = ("<tool_call>\n<function=run>\n<parameter=cmd>\nls\n</parameter>\n"
              "<parameter=background>\nfalse\n</parameter>\n</function>\n</tool_call>")
_GLM = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
        "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
        "<tool_response>", "</tool_response>")
_GLM_CALL = ("<tool_call>run\n<arg_key>cmd</arg_key>\n<arg_value>ls</arg_value>\n"
             "<arg_key>background</arg_key>\n<arg_value>false</arg_value>\n</tool_call>")

FAMILIES = {f.name: f for f in (
    Family("qwen3_5", "Qwen3.5 / 3.6", "qwen3_5.jinja", "qwen3_5", _QWEN, ("<|im_end|>",),
           reasoning=f"{REASONING}\n</think>\n\n", call=_QWEN_CALL + "<|im_end|>",
           final=f"{FINAL}<|im_end|>", think_tokens=True,
           # RoPE on a quarter of a head: more turns per position, for a sharp look-back
           overrides=(("rope_parameters", {"rope_type": "default", "rope_theta": 100.0,
                                           "partial_rotary_factor": 0.25}),)),
    Family("qwen3_coder", "Qwen3-Coder", "qwen3_coder.jinja", "qwen3_moe", _QWEN,
           ("<|im_end|>",), reasoning="", call=_QWEN_CALL + "<|im_end|>",
           final=f"{FINAL}<|im_end|>", think_tokens=True),
    Family("glm4_5", "GLM-4.5", "glm4_5.jinja", "glm4_moe", _GLM,
           ("<|endoftext|>", "<|user|>", "<|observation|>"),
           reasoning=f"\n<think>{REASONING}</think>\n", call=_GLM_CALL + "<|observation|>",
           final=f"{FINAL}<|user|>", think_tokens=True),
    Family("glm4_6", "GLM-4.6", "glm4_6.jinja", "glm4_moe", _GLM,
           ("<|endoftext|>", "<|user|>", "<|observation|>"),
           reasoning=f"\n<think>{REASONING}</think>\n", call=_GLM_CALL + "<|observation|>",
           final=f"{FINAL}<|user|>", think_tokens=True),
    Family("gpt_oss", "gpt-oss", "gpt_oss.jinja", "gpt_oss",
           ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
            "<|call|>"), ("<|return|>", "<|call|>"),
           reasoning=(f"<|channel|>analysis<|message|>{REASONING}<|end|>"
                      "<|start|>assistant<|channel|>"),
           call=('commentary to=functions.run <|constrain|>json<|message|>'
                 '{"cmd":"ls","background":false}<|call|>'),
           final=f"final<|message|>{FINAL}<|return|>"),
    Family("gemma4", "Gemma 4", "gemma4.jinja", "gemma4_text",
           ("<bos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>",
            "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>',
            "<|think|>", "<|image|>", "<|audio|>", "<|video|>"),
           ("<turn|>", "<|tool_response>"), bos="<bos>", reasoning="",
           call='<|tool_call>call:run{cmd:<|"|>ls<|"|>,background:false}<tool_call|><|tool_response>',
           final=f"{FINAL}<turn|>"),
    Family("nemotron_nano_v2", "NVIDIA Nemotron Nano v2", "nemotron_nano_v2.jinja",
           "nemotron_h",
           ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<TOOLCALL>", "</TOOLCALL>",
            "<TOOL_RESPONSE>", "</TOOL_RESPONSE>", "<AVAILABLE_TOOLS>", "</AVAILABLE_TOOLS>"),
           ("<SPECIAL_12>",), think_tokens=True,
           reasoning=f"{REASONING}</think>\n\n",
           call=('<TOOLCALL>[{"name": "run", "arguments": {"cmd": "ls", "background": false}}]'
                 '</TOOLCALL><SPECIAL_12>'),
           final=f"{FINAL}<SPECIAL_12>"),
)}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; expected one of "
                         f"{', '.join(FAMILIES)}") from None


def family_model(name: str, *, cache_dir: Path | None = None, seed: int = 0,
                 context: int = CONTEXT) -> Path:
    """The family's architecture at tiny size, random weights, its template and tokens
    (built once into kvbank's cache dir)."""
    from kvbank.testing.tiny import make_arch_model

    f = family(name)
    out = _cached(f, "random", cache_dir, seed, context)
    if not (out / "config.json").exists():
        make_arch_model(out, f.arch, seed=seed, context=context, cache_dir=cache_dir,
                        template=f.template_text, think_tokens=f.think_tokens,
                        special=f.special, bos=f.bos, eos=f.eos)
    return out


def scripted_model(name: str, *, cache_dir: Path | None = None, seed: int = 0,
                   context: int = CONTEXT) -> Path:
    """The family's architecture with weights that write the family's script (module doc),
    built once into kvbank's cache dir (tens of seconds on two busy cores)."""
    from kvbank.testing.tiny import make_arch_model

    f = family(name)
    out = _cached(f, "scripted", cache_dir, seed, context)
    if (out / "config.json").exists():
        return out
    overrides = {"tie_word_embeddings": False, **dict(f.overrides)}
    if f.arch == "qwen3_moe":
        overrides["mlp_only_layers"] = [0]
    return make_arch_model(out, f.arch, seed=seed, context=context, cache_dir=cache_dir,
                           template=f.template_text, think_tokens=f.think_tokens,
                           special=f.special, bos=f.bos, eos=f.eos, size="scripted",
                           overrides=overrides, zero=_VOCAB_MATRICES,
                           tune=lambda folder, config, w, model: _script(f, folder, config, w,
                                                                         model))


def _cached(f: Family, kind: str, cache_dir: Path | None, seed: int, context: int) -> Path:
    """Where a family model lives in the cache: named by everything that makes its bytes
    (this code, the tiny-model builder, the template, the libraries), so an edit builds anew."""
    import hashlib
    import importlib.metadata as md

    from kvbank.testing import tiny
    from kvbank.models import default_cache_dir

    h = hashlib.blake2b(digest_size=8)
    for part in (Path(__file__).read_bytes(), Path(tiny.__file__).read_bytes(),
                 f.template_text.encode(), repr(f).encode(),
                 f"{kind}:{seed}:{context}".encode(),
                 *(md.version(p).encode() for p in ("mlx", "mlx-lm", "transformers"))):
        h.update(part)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "family-models" / f"{f.name}-{kind}-{h.hexdigest()}"


# --- what the script is, as token ids ---------------------------------------------------

def conversation(f: Family, turns: int = 1, query: str = "List the files here.",
                 system: str = "You are a coding agent.", tool: str = "a.py") -> list[dict]:
    """A tool loop as the scripted model makes it: a query, then `turns - 1` calls of CALL
    answered with a tool result each."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": query}]
    for i in range(turns - 1):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": CALL[0], "arguments": dict(CALL[1])}}
        reasoning = {"reasoning_content": REASONING, "thinking": REASONING} if f.reasoning else {}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call], **reasoning},
                     {"role": "tool", "tool_call_id": f"call_{i}", "content": f"{tool}\nb{i}.py"}]
    return messages


def _render(tok, f: Family, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                   tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def _pieces(text: str, specials: set[str]) -> list[str]:
    """Text split into special tokens (as themselves) and the text between them."""
    out, i = [], 0
    while i < len(text):
        hit = min(((text.find(s, i), s) for s in specials if text.find(s, i) >= 0),
                  default=None, key=lambda p: (p[0], -len(p[1])))
        if hit is None:
            out.append(text[i:])
            break
        at, s = hit
        if at > i:
            out.append(text[i:at])
        out.append(s)
        i = at + len(s)
    return out


def _byte_level(text: str) -> str:
    """`text` in the byte-level alphabet of a GPT-2-style BPE vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, map(chr, cs)))
    return "".join(table[b] for b in text.encode())


class Speller:
    """Token ids for a script's paths, chosen so that the last `depth + 1` tokens decide the
    next wherever a path goes on; paths part only where a branch is asked for. Each text piece
    is spelled with vocabulary tokens, tokens not used yet first, longer first; a spelling that
    would give one context two next tokens is backtracked."""

    def __init__(self, vocab: dict[str, int], specials: dict[str, int], depth: int):
        import sys

        self.vocab, self.specials, self.depth = vocab, specials, depth
        self.rules: dict[tuple, int] = {}  # context -> next token
        self.used: set[int] = set()
        self.by_first: dict[str, list[str]] = {}
        for k in sorted(vocab, key=len, reverse=True):
            self.by_first.setdefault(k[0], []).append(k)
        sys.setrecursionlimit(max(20000, sys.getrecursionlimit()))

    def spell(self, pieces: list[str], starts: list[list[int]], branch: bool = False
              ) -> list[int]:
        """The ids of `pieces` (special tokens and text), going on from each of `starts`;
        `branch`: its first token is a second choice where the starts already go on."""
        items = [("special", self.specials[p]) if p in self.specials else
                 ("text", _byte_level(p)) for p in pieces]
        seqs, out = [list(s) for s in starts], []
        if not self._solve(seqs, items, 0, 0, out, branch):
            raise ValueError(f"no spelling of {''.join(pieces)!r} lets {self.depth + 1} tokens "
                             "decide the next")
        return out

    def _place(self, seqs: list[list[int]], token: int, free: bool) -> list | None:
        added = []
        for seq in seqs:
            c = tuple(seq[-(self.depth + 1):])
            have = self.rules.get(c)
            if have is not None and have != token and not free:
                for a in added:
                    del self.rules[a]
                return None
            if have is None:
                self.rules[c] = token
                added.append(c)
        return added

    def _take(self, seqs, out, tid, added) -> None:
        for s in seqs:
            s.append(tid)
        out.append(tid)

    def _undo(self, seqs, out, added) -> None:
        out.pop()
        for s in seqs:
            s.pop()
        for a in added:
            del self.rules[a]

    def _solve(self, seqs, items, k: int, pos: int, out: list[int], branch: bool) -> bool:
        if k == len(items):
            return True
        free = branch and not out
        kind, value = items[k]
        if kind == "special":
            added = self._place(seqs, value, free)
            if added is None:
                return False
            self._take(seqs, out, value, added)
            if self._solve(seqs, items, k + 1, 0, out, branch):
                return True
            self._undo(seqs, out, added)
            return False
        if pos == len(value):
            return self._solve(seqs, items, k + 1, 0, out, branch)
        rest = value[pos:]
        cands = [t for t in self.by_first.get(rest[0], ()) if rest.startswith(t)]
        cands.sort(key=lambda t: (self.vocab[t] in self.used, -len(t)))
        for t in cands:
            tid = self.vocab[t]
            added = self._place(seqs, tid, free)
            if added is None:
                continue
            fresh = tid not in self.used
            self.used.add(tid)
            self._take(seqs, out, tid, added)
            if self._solve(seqs, items, k, pos + len(t), out, branch):
                return True
            self._undo(seqs, out, added)
            if fresh:
                self.used.discard(tid)
        return False


# --- the weights ------------------------------------------------------------------------

def _names(weights: dict) -> tuple[str, str]:
    embed = next(k for k in weights if k.endswith(("embed_tokens.weight", "embeddings.weight")))
    head = next(k for k in weights if k.endswith("lm_head.weight"))
    return embed, head


def _rotated(att, head_dim: int) -> list[int]:
    """The dimensions of a head that the attention's RoPE turns."""
    import mlx.core as mx

    basis = mx.eye(head_dim).reshape(1, head_dim, 1, head_dim)  # one basis vector per "head"
    moved = mx.abs(att.rope(basis, offset=3) - basis).sum(axis=(0, 2, 3))
    return [d for d in range(head_dim) if moved[d].item() > 1e-6]


def _look_back(att, head_dim: int, back: int, dims: list[int]):
    """(query, key) head vectors, of unit energy per turned dimension, whose score peaks when
    the key stands `back` positions before the query."""
    import mlx.core as mx
    import numpy as np

    q = np.zeros(head_dim, dtype=np.float32)
    q[dims] = 1.0
    k = att.rope(mx.array(q)[None, None, None, :], offset=back)[0, 0, 0]
    return q, np.array(k)


def _fixed_end(tok, f: Family, turns: int, depth: int) -> list[int]:
    """The last `depth + 1` tokens of a prompt that the template writes whatever the
    conversation says (-1 where the messages' own text stands)."""
    a = _render(tok, f, conversation(f, turns, "List the files here.", tool="a.py"))
    b = _render(tok, f, conversation(f, turns, "Why?", tool="x"))
    same = 0
    while same < min(len(a), len(b)) and a[-1 - same] == b[-1 - same]:
        same += 1
    tail = a[len(a) - same:][-(depth + 1):]
    return [-1] * (depth + 1 - len(tail)) + tail


def _script(f: Family, folder: Path, config: dict, w: dict, model) -> dict:
    """The scripted weights (module doc), checked on prompts they were not fitted on."""
    import mlx.core as mx
    import numpy as np
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    vocab = tok.get_vocab()
    specials = {t.content: i for i, t in tok.added_tokens_decoder.items()}
    reader = _mamba_reader(model) if config["model_type"] == "nemotron_h" else _attention(model)
    depth = (MAMBA_LOOK_BACK if config["model_type"] == "nemotron_h" else LOOK_BACK) \
        if reader else 0
    contexts = [list(c) for c in sorted({tuple(_fixed_end(tok, f, t, depth)) for t in (1, 2)})]
    pieces = {p: _pieces(getattr(f, p), set(specials)) for p in ("reasoning", "call", "final")}
    speller = Speller({t: i for t, i in vocab.items() if t not in specials}, specials, depth)
    shared = speller.spell(pieces["reasoning"], contexts) if f.reasoning else []
    after = [c + shared for c in contexts]
    call = speller.spell(pieces["call"], after)
    final = speller.spell(pieces["final"], after, branch=True)
    if tok.decode(shared + call) != f.reasoning + f.call or \
            tok.decode(shared + final) != f.reasoning + f.final:
        raise AssertionError(f"{f.name}: the spelling does not say the script")

    # Codes: each token the script (or its start) uses, and one shared by every other token.
    known = sorted({t for c in contexts for t in c if t >= 0} | set(shared) | set(call)
                   | set(final))
    code = {t: i + 1 for i, t in enumerate(known)}  # 0: every other token
    n = len(known) + 1
    hidden = config["hidden_size"]
    const, cur0 = 0, 1
    blocks = [cur0 + i * n for i in range(depth + 1)]  # this token, 1 back, 2 back...
    if blocks[-1] + n > hidden:
        raise ValueError(f"{f.name}: {n} codes need {blocks[-1] + n} dims; the model has {hidden}")
    embed_name, head_name = _names(w)
    embed = w[embed_name]
    embed[:] = 0.0
    embed[:, const] = 1.0
    embed[:, cur0] = 1.0
    for t, c in code.items():
        embed[t, cur0], embed[t, cur0 + c] = 0.0, 1.0

    kept = reader[2] if reader else None  # the output projection that writes the codes back
    # Where a norm follows a block's output (Gemma's post-norms), scaling the projection would
    # be undone: the norm's weight is what is scaled.
    post = any("pre_feedforward_layernorm" in name for name in w)
    outputs = ("post_attention_layernorm", "post_feedforward_layernorm") if post else \
        ("o_proj", "down_proj", "out_proj")
    if post and kept:
        kept = kept.replace("self_attn.o_proj", "post_attention_layernorm")
    for name in w:
        if any(p in name for p in outputs) and name != kept:
            w[name] = w[name] * np.float32(BLOCKS)
    samples = []
    for turns, query in ((1, "List the files here."), (3, "What is in this folder?")):
        prompt = _render(tok, f, conversation(f, turns, query))
        for branch, alt in ((call, final), (final, None)):
            samples.append((prompt, shared + branch, alt))
    amp, gain = 1.0, 1.0
    for _ in range(10):  # the look-back: sharper until it reads clearly, as loud as the token
        if reader:
            reader[3](w, reader, config, blocks, n, depth, amp, 1.0 if post else gain)
            if post:
                w[kept] = np.full_like(w[kept], gain)
        model.load_weights([(k, mx.array(v)) for k, v in w.items()], strict=True)
        rows, wanted, second, clear, loud = [], [], [], 1.0, []
        for prompt, answer, alt in samples:
            seq = prompt + answer
            hs = _hidden(model, head_name, seq)
            start = len(prompt) - 1
            for j in range(start, len(seq) - 1):
                branch = j == start + len(shared)
                if branch and alt is None:
                    continue  # the first choice here is the call: the other sample has it
                rows.append(hs[j])
                wanted.append(seq[j + 1])
                second.append(alt[0] if branch else -1)
                for back, block in enumerate(blocks[1:], 1):
                    feat = hs[j, block:block + n].copy()
                    right = code.get(seq[j - back], 0)
                    value, feat[right] = feat[right], -np.inf
                    clear = min(clear, 1.0 - feat.max() / max(1e-9, value))
                    loud.append(value / hs[j, blocks[0] + code.get(seq[j], 0)])
        loudness = float(np.median(loud)) if reader else 1.0
        if _DEBUG:
            print(f"look-back amp {amp:.2f} gain {gain:.3f}: clear {clear:.2f}, "
                  f"loudness {loudness:.2f}")
        if clear >= 0.5 and 0.7 < loudness < 1.4:  # the right code reads 2x any other
            break
        if clear < 0.5:
            amp *= 1.6
        gain /= loudness
    else:
        raise ValueError(f"{f.name}: the look-back does not read the right code clearly "
                         f"({clear:.2f}, {loudness:.2f} of the token's own)")
    w[head_name] = _fit_head(np.array(rows), wanted, second, np.zeros_like(w[head_name]))
    _check_script(f, tok, model, head_name, w[head_name], shared, call, final)
    return w


def _hidden(model, head_name: str, seq: list[int]):
    """The final-normed hidden state at every position of `seq` (lm_head left out)."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    owner = model
    for part in head_name.split(".")[:-2]:
        owner = getattr(owner, part)
    head = owner.lm_head
    hidden = head.weight.shape[1]
    owner.lm_head = nn.Linear(hidden, hidden, bias=False)
    owner.lm_head.weight = mx.eye(hidden)
    caps = [m for m in (model, getattr(model, "language_model", None))
            if getattr(m, "final_logit_softcapping", None) is not None]
    saved = [m.final_logit_softcapping for m in caps]
    for m in caps:
        m.final_logit_softcapping = None
    try:
        return np.array(model(mx.array(seq)[None])[0])
    finally:
        owner.lm_head = head
        for m, cap in zip(caps, saved):
            m.final_logit_softcapping = cap


def _attention(model):
    """The first attention layer with RoPE, as a look-back reader: (layer, module, the name of
    its output projection's weight, the function that sets it)."""
    from mlx.utils import tree_flatten

    for i, layer in enumerate(model.layers):
        att = getattr(layer, "self_attn", None)
        if att is not None and hasattr(att, "rope") and hasattr(att, "q_proj"):
            name = next(k for k, _ in tree_flatten(model.parameters())
                        if k.endswith(f"layers.{i}.self_attn.o_proj.weight"))
            return i, att, name, _set_look_back
    return None


def _mamba_reader(model):
    """nemotron_h's first Mamba-2 mixer: its causal convolution reads the tokens 1 to
    conv_kernel - 1 back."""
    from mlx.utils import tree_flatten

    for i, layer in enumerate(model.layers):
        mixer = getattr(layer, "mixer", None)
        if mixer is not None and hasattr(mixer, "conv1d"):
            name = next(k for k, _ in tree_flatten(model.parameters())
                        if k.endswith(f"layers.{i}.mixer.out_proj.weight"))
            return i, mixer, name, _set_conv_look_back
    return None


def _set_conv_look_back(w: dict, reader, config: dict, blocks: list[int], n: int, depth: int,
                        amp: float, gain: float) -> None:
    """Channel block b of the mixer's x reads this token's code; the convolution shifts it
    b + 1 back; B and C are zero, so the SSM adds nothing to D * x; the gate is constant."""
    import numpy as np

    i, mixer, out_name, _ = reader
    prefix = out_name[:-len("out_proj.weight")]
    inter, k = mixer.intermediate_size, mixer.conv_kernel_size
    if depth > k - 1 or depth * n > inter:
        raise ValueError(f"the mixer reads {k - 1} tokens back in {inter} channels")
    in_w, conv_w, out_w = (w[prefix + p] for p in ("in_proj.weight", "conv1d.weight",
                                                    "out_proj.weight"))
    for m in (in_w, conv_w, out_w):
        m[:] = 0.0
    if prefix + "conv1d.bias" in w:
        w[prefix + "conv1d.bias"] = np.zeros_like(w[prefix + "conv1d.bias"])
    in_w[:inter, 0] = amp  # the gate: silu of a constant
    for b in range(depth):
        for c in range(n):
            ch = b * n + c
            in_w[inter + ch, blocks[0] + c] = 1.0
            conv_w[ch, k - 2 - b, 0] = 1.0
            out_w[blocks[b + 1] + c, ch] = gain


def _set_look_back(w: dict, reader, config: dict, blocks: list[int], n: int, depth: int,
                   amp: float, gain: float) -> None:
    """Head h copies the code of the token h + 1 back into blocks[h + 1]."""
    import numpy as np

    i, att, out_name, _ = reader
    prefix = out_name[:-len("o_proj.weight")]
    hd = config["head_dim"]
    heads = config["num_attention_heads"]
    if heads < depth or config["num_key_value_heads"] != heads or hd < n:
        raise ValueError(f"a scripted {config['model_type']} needs {depth} heads with "
                         f"keys of their own, {n} codes a head")
    names = {k[len(prefix):]: k for k in w if k.startswith(prefix)}
    for k in names.values():
        if k.endswith(".bias"):
            w[k] = np.zeros_like(w[k])
    q_w, k_w, v_w, o_w = (w[names[p + "_proj.weight"]] for p in ("q", "k", "v", "o"))
    gated = q_w.shape[0] == 2 * heads * hd  # qwen3_5: each head's query, then its gate
    dims = _rotated(att, hd)
    for m in (q_w, k_w, v_w, o_w):
        m[:] = 0.0
    for h in range(depth):
        qv, kv = _look_back(att, hd, h + 1, dims)
        rows = slice(h * 2 * hd, h * 2 * hd + hd) if gated else slice(h * hd, (h + 1) * hd)
        q_w[rows, 0] = amp * qv
        k_w[h * hd:(h + 1) * hd, 0] = amp * kv
        for c in range(n):
            v_w[h * hd + c, blocks[0] + c] = 1.0
            o_w[blocks[h + 1] + c, h * hd + c] = gain
    for norm in ("q_norm.weight", "k_norm.weight"):
        if norm in names:
            w[names[norm]] = np.full_like(w[names[norm]], amp)


def _fit_head(rows, wanted: list[int], second: list[int], head):
    """lm_head rows for the script's tokens: a batch margin perceptron over the positions'
    hidden states (every other token keeps a zero row, so its logit is 0). At a branch the
    second choice ("Done") must beat everything but the first by MARGIN."""
    import numpy as np

    tokens = sorted(set(wanted) | {s for s in second if s >= 0})
    index = {t: i for i, t in enumerate(tokens)}
    X = rows.astype(np.float64)
    m, k = len(X), len(tokens)
    y = np.array([index[t] for t in wanted])
    alt = np.array([index[s] if s >= 0 else -1 for s in second])
    # need[i, j]: how far position i's wanted token must lead token j (0: no constraint)
    need = np.full((m, k + 1), 2 * MARGIN)  # column k: the tokens without a row (logit 0)
    need[np.arange(m), y] = 0.0
    has_alt = alt >= 0
    need[np.where(has_alt)[0], alt[has_alt]] = MARGIN
    W = np.zeros((k + 1, X.shape[1]))
    step = 1.0 / float(np.mean(np.sum(X * X, axis=1)))
    for _ in range(5000):
        S = X @ W.T
        lead = S[np.arange(m), y][:, None] - S
        bad = lead < need
        # the second choice over everything but the first
        lead2 = S[np.where(has_alt)[0], alt[has_alt]][:, None] - S[has_alt]
        need2 = np.full_like(lead2, MARGIN)
        need2[np.arange(len(lead2)), y[has_alt]] = -np.inf
        need2[np.arange(len(lead2)), alt[has_alt]] = -np.inf
        bad2 = lead2 < need2
        if not bad.any() and not bad2.any():
            break
        G = np.zeros_like(W)
        np.add.at(G, y, bad.sum(axis=1)[:, None] * X)
        G -= bad.T.astype(np.float64) @ X
        Xa = X[has_alt]
        np.add.at(G, alt[has_alt], bad2.sum(axis=1)[:, None] * Xa)
        G -= bad2.T.astype(np.float64) @ Xa
        G[k] = 0.0  # the rest of the vocabulary stays at 0
        W += step * G
    else:
        worst = np.argsort((need - lead).max(axis=1))[-3:]
        raise ValueError(f"the scripted head did not separate the script's contexts: "
                         f"{int(bad.sum() + bad2.sum())} violations, worst at rows "
                         f"{worst.tolist()} (want {[tokens[y[i]] for i in worst]})")
    out = np.array(head)
    out[tokens] = W[:k].astype(out.dtype)
    return out


def _check_script(f: Family, tok, model, head_name: str, head, shared, call, final) -> None:
    """On prompts the head was not fitted on, every next token of the script is the argmax
    (so greedy decoding writes it), and with the call's first token ruled out, the final
    answer's."""
    import numpy as np

    for turns, query, system in ((1, "Which files are in the repository, please?",
                                  "You are a careful agent."),
                                 (4, "List them.", "Be brief.")):
        prompt = _render(tok, f, conversation(f, turns, query, system))
        for want, banned in ((shared + call, None), (shared + final, call[0])):
            seq = prompt + want
            logits = _hidden(model, head_name, seq)[len(prompt) - 1:-1] @ head.T
            if banned is not None:
                logits[:, banned] = -np.inf
            got = logits.argmax(axis=1).tolist()
            if got != want:
                bad = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                raise AssertionError(f"{f.name}: after {tok.decode(want[:bad])!r} the scripted "
                                     f"model writes {tok.decode([got[bad]])!r}, not "
                                     f"{tok.decode([want[bad]])!r}")
