"""Every model kind kvbank serves answers as mlx-lm does from scratch: from RAM, from SSD after
a release, and after a kill -9 of the worker.

Tiny random models of each architecture (kvbank/testing/tiny.py: full attention, sliding
windows, Gated DeltaNet and Mamba layers, and layers that keep a list of caches: Falcon-H1's and
Baichuan-M1's) run in a real stack. An unnamed conversation takes turns through it, and every
answer is compared with two references computed here with mlx-lm's own
model and caches on the same prompt ids:
- the same forwards the worker made (its restore point, prefill chunks and checkpoint splits,
  one decode token at a time): greedy tokens equal and each token's logprob within 1e-4;
- one unsplit forward of the whole prompt: greedy tokens equal (forward boundaries move the
  numbers by far less than a token flip at these sizes).
A restore that loses a window's ring order or a recurrent state is off by 0.05-0.25 there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import matrix, start_stack

ARCHS = ("qwen3", "gpt_oss", "gemma3_text", "qwen3_5", "nemotron_h", "mamba2", "falcon_h1",
         "baichuan_m1")  # the last two: a CacheList per layer
WINDOW = 32  # shorter than a turn: a restored window must be the ring, not the whole turn
MAX_TOKENS = 40
TEMPLATES = Path(__file__).parent.parent / "kvbank" / "testing" / "templates"


class Reference:
    """mlx-lm's greedy answers from scratch, with the conversation's forwards replayed."""

    def __init__(self, model_dir: Path, max_tokens: int = MAX_TOKENS, top_n: int = 0):
        from mlx_lm import load

        from kvbank.router.tokenizer import PromptTokenizer

        self.model, self.tokenizer = load(str(model_dir))
        self.prompts = PromptTokenizer(model_dir)
        self.eos = set(self.tokenizer.eos_token_ids)
        self.max_tokens = max_tokens
        self.top_n = top_n  # and the last answer's `top_n` most likely logprobs (`tops`)
        self.tops: list[list[float]] = []
        self.lineage: list[tuple[int, int]] = []  # the forwards behind the last turn's cache
        self.tokens: list[int] = []  # what they read

    def _forward(self, cache, ids):
        import mlx.core as mx

        logits = self.model(mx.array(ids)[None], cache=cache)[0, -1]
        logprobs = logits - mx.logsumexp(logits)
        mx.eval(logprobs)
        return logprobs

    def _greedy(self, cache, logprobs, max_tokens):
        import mlx.core as mx

        out, lps, self.tops = [], [], []
        while True:
            token = int(logprobs.argmax().item())
            out.append(token)
            lps.append(float(logprobs[token].item()))
            if self.top_n:
                self.tops.append(mx.sort(logprobs)[::-1][:self.top_n].tolist())
            if token in self.eos or len(out) >= max_tokens:
                return out, lps
            logprobs = self._forward(cache, [token])

    def turn(self, prompt: list[int], cached: int, marks: list[int], checkpointed: bool):
        """The worker's forwards for this turn: the lineage up to its restore point, then its
        prompt read from there, then one token at a time (the last one too: it is in the
        committed cache)."""
        from kvbank.worker.compute.scheduler import LAST_FORWARD_TOKENS, PREFILL_STEP_TOKENS

        assert self.tokens[:cached] == prompt[:cached]
        cache, kept = self.restored(prompt, cached)
        splits = sorted(p for p in marks if cached < p < len(prompt)) if checkpointed else []
        pos, logprobs = cached, None
        while pos < len(prompt):
            left = len(prompt) - pos
            n = min(PREFILL_STEP_TOKENS, left - LAST_FORWARD_TOKENS) if left > LAST_FORWARD_TOKENS else 0
            split = next((p for p in splits if pos < p), None)
            if split is not None and (n == 0 or split < pos + n):
                n = split - pos
            n = n or left
            logprobs = self._forward(cache, prompt[pos:pos + n])
            kept.append((pos, pos + n))
            pos += n
            self.stood(cache, pos)
        answer, lps = self._greedy(cache, logprobs, self.max_tokens)
        self._forward(cache, answer[-1:])
        kept += [(len(prompt) + i, len(prompt) + i + 1) for i in range(len(answer))]
        self.lineage, self.tokens = kept, prompt + answer
        self.last = cache
        self.committed(cache, cached, len(self.tokens))
        return answer, lps

    def restored(self, prompt: list[int], cached: int):
        """The cache the worker restored at `cached`, and the forwards behind it: here the
        lineage's forwards replayed, or, where all of the last turn was restored, the cache
        those forwards left (a hook: tests/test_kv_bits.py keeps it quantized)."""
        from mlx_lm.models.cache import make_prompt_cache

        if cached == len(self.tokens) and getattr(self, "last", None) is not None:
            cache, self.last = self.last, None
            return cache, list(self.lineage)
        cache = make_prompt_cache(self.model)
        kept = []
        for s, e in self.lineage:
            if s >= cached:
                break
            kept.append((s, min(e, cached)))
            self._forward(cache, prompt[s:min(e, cached)])
        return cache, kept

    def stood(self, cache, pos: int) -> None:
        """A hook: a prompt's forward stopped at `pos`, where the worker may checkpoint."""

    def committed(self, cache, cached: int, n_tokens: int) -> None:
        """A hook: the worker committed the turn's cache (tokens [cached, n_tokens) new)."""

    def unsplit(self, prompt: list[int]) -> list[int]:
        from mlx_lm.models.cache import make_prompt_cache

        cache, tops = make_prompt_cache(self.model), self.tops
        out = self._greedy(cache, self._forward(cache, prompt), self.max_tokens)[0]
        self.tops = tops  # the turn's
        return out


def _model(tmp_path_factory, cache_dir, arch: str, template: str | None) -> Path:
    from kvbank.testing.tiny import make_arch_model

    out = tmp_path_factory.mktemp(f"{arch}-model") / "model"
    return make_arch_model(out, arch, seed=1, context=4096, window=WINDOW, template=template,
                           cache_dir=cache_dir)


@pytest.fixture(scope="module")
def stripping(tmp_path_factory, cache_dir):
    """`stripping(arch)`: (model, stack) with kvbank/testing/tiny.py's reasoning-stripping template, one
    per architecture, shared by the tests that neither kill nor reconfigure it. Each test's
    conversation opens with a system prompt of its own, so none finds another's in cache."""
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            model = _model(tmp_path_factory, cache_dir, arch, None)
            made[arch] = model, start_stack(model, tmp_path_factory.mktemp(f"{arch}-strip"),
                                            cache_dir=cache_dir, shim=False)
        return made[arch]

    yield get
    for _, s in made.values():
        s.stop()


def send_back(s, c, session: str | None, where: str) -> None:
    """Before a returning turn: the conversation out of RAM (`ssd after a release`), or the
    worker killed once it is on SSD (`ssd after kill -9`); `first` and `ram` leave it be."""
    if where == "ssd after a release":
        c.release(session)
    elif where == "ssd after kill -9":
        s.wait_durable(session)
        s.wait_restarted("worker", s.kill9("worker"))


def _check(ref: Reference, got, prompt: list[int], marks: list[int], checkpointed: bool,
           where: str, unsplit: bool = True) -> None:
    cached = got.usage["cached_tokens"]
    want, want_lps = ref.turn(prompt, cached, marks, checkpointed)
    emitted = [t for t in want if t not in ref.eos]
    assert got.token_ids == emitted, f"{where}: greedy tokens differ from mlx-lm's"
    diffs = np.abs(np.asarray(got.logprobs) - np.asarray(want_lps[:len(got.logprobs)]))
    assert diffs.max(initial=0.0) < 1e-4, f"{where}: logprobs off by {diffs.max():.2g}"
    if not unsplit:
        return
    flat = [t for t in ref.unsplit(prompt) if t not in ref.eos]
    assert got.token_ids == flat, f"{where}: unsplit mlx-lm answers otherwise"


# make test: state + full (a CacheList's seam: tests/test_cache_kinds.py's fake, its stacks
# here in make test-all; gpt-oss: its harmony template with tools below)
@pytest.mark.parametrize("arch", matrix(ARCHS + ("gpt_oss harmony",), keep=("qwen3_5",)))
def test_a_conversation_continues_exactly_from_ram_ssd_and_after_kill_9(
        arch, tmp_path_factory, cache_dir):
    """Four unnamed turns: from RAM, from SSD after a release, from SSD after a kill -9. Each
    returning turn reads the whole previous prompt and answer from cache. `gpt_oss harmony`:
    gpt-oss's published template (harmony) and tokens, the answers spliced back in it."""
    if arch == "gpt_oss harmony":
        from kvbank.testing.family_models import family_model

        model = family_model("gpt_oss", cache_dir=cache_dir)
    else:
        template = (TEMPLATES / "qwen_tools.jinja").read_text()  # keeps answers as generated
        model = _model(tmp_path_factory, cache_dir, arch, template)
    ref = Reference(model)
    s = start_stack(model, tmp_path_factory.mktemp(f"{arch.replace(' ', '-')}-data"),
                    cache_dir=cache_dir, shim=False)
    try:
        messages = [{"role": "system", "content": "You are a careful coding agent."},
                    {"role": "user", "content": "Read the parser and list its three bugs."}]
        checkpointed = arch not in ("qwen3",)
        previous = 0
        for turn, where in enumerate(("first", "ram", "ssd after a release", "ssd after kill -9")):
            with s.client() as c:
                send_back(s, c, session if turn else None, where)
                prompt = c.render(messages=messages, max_tokens=MAX_TOKENS)
                got = c.generate(messages=messages, max_tokens=MAX_TOKENS, logprobs=True)
            session = got.usage["session_id"]
            marks = ref.prompts.checkpoints(messages, prompt)
            assert got.usage["cache_source"] == ("none" if turn == 0 else where.split()[0])
            assert got.usage["cached_tokens"] >= previous, got.usage  # all of the last turn
            assert got.usage["prefix_lost_tokens"] == 0, got.usage
            _check(ref, got, prompt, marks, checkpointed, f"{arch} turn {turn} ({where})")
            previous = len(prompt) + got.usage["completion_tokens"]
            messages += [{"role": "assistant", "content": got.text},
                         {"role": "user", "content": f"Now fix bug {turn + 1}."}]
    finally:
        s.stop()


# gpt-oss's own template strips earlier reasoning too: make test runs that path in
# test_a_gpt_oss_tool_loop_answers_as_mlx_lm_from_scratch (RAM, SSD, kill -9); these two run
# gpt_oss in make test-all.
@pytest.mark.parametrize("arch", matrix(("qwen3_5", "gpt_oss"), keep=("qwen3_5",)))
def test_a_template_that_strips_reasoning_still_restores_the_previous_prompt(arch, stripping):
    """Qwen3.5's template drops earlier answers' reasoning from the history, so the next
    prompt leaves the last one right after its generation prompt: the checkpoint taken before
    that generation prompt serves it, exactly."""
    model, s = stripping(arch)
    ref = Reference(model)
    messages = [{"role": "system", "content": "Think, then answer."},
                {"role": "user", "content": "Which file holds the parser?"}]
    with s.client() as c:
        for turn in range(3):
            prompt = c.render(messages=messages, max_tokens=MAX_TOKENS)
            got = c.generate(messages=messages, max_tokens=MAX_TOKENS, logprobs=True)
            marks = ref.prompts.checkpoints(messages, prompt)
            if turn:
                gen = len(ref.prompts.encode("<|im_start|>assistant\n<think>\n"))
                assert got.usage["cached_tokens"] >= last_prompt - gen, got.usage
                assert got.usage["recomputed_tokens"] == 0, got.usage
                # what lies between that checkpoint and where the prompts part is counted
                assert 0 < got.usage["prefix_lost_tokens"] <= gen, got.usage
            _check(ref, got, prompt, marks, True, f"{arch} turn {turn}")
            last_prompt = len(prompt)
            messages += [{"role": "assistant",
                          "content": f"<think>\nlooking\n</think>\n\n{got.text}"},
                         {"role": "user", "content": "And the tests?"}]


def test_a_model_with_an_unknown_cache_kind_is_refused_at_start(tmp_path, cache_dir):
    """A cache class the seam does not know (here a ChunkedKVCache, which llama4 uses) is
    refused before anything is served, with a message that names it and says what to do."""
    import subprocess
    import sys

    from kvbank.testing.tiny import make_arch_model

    model = make_arch_model(tmp_path / "model", "llama", cache_dir=cache_dir)
    script = (
        "from kvbank.config import preload_openblas; preload_openblas()\n"
        "import mlx_lm.models.llama as llama\n"
        "from mlx_lm.models.cache import ChunkedKVCache\n"
        "llama.Model.make_cache = lambda self: [ChunkedKVCache(64) for _ in self.layers]\n"
        "import sys; from kvbank.apps.cli import main\n"
        f"sys.exit(main(['worker', '--model', {str(model)!r}, '--data-dir', "
        f"{str(tmp_path / 'data')!r}, '--metrics-port', '0']))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).parent.parent)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "refused to serve" in last and "'llama'" in last and "ChunkedKVCache" in last, last
    assert "Traceback" not in out.stderr


def test_the_seed_policies_hold_for_checkpoints(tmp_path_factory, cache_dir):
    """A hybrid model's entries carry checkpoints (every 64 tokens here): a warning trim keeps
    an unwritten one and takes one on SSD, a release writes out first and the next turn
    restores from SSD, a critical trim takes what is idle and counts what was unwritten."""
    from tests.test_admission import NO_IDLE_WRITES, _sessions, _turn, _wait_receipt

    model = _model(tmp_path_factory, cache_dir, "qwen3_5", None)
    s = start_stack(model, tmp_path_factory.mktemp("qwen3_5-policies"), cache_dir=cache_dir,
                    shim=False, extra=[*NO_IDLE_WRITES, "--checkpoint-every", "64"])
    try:
        with s.client() as c:
            _turn(c, "on-ssd", 200, seed=1)
            assert c.flush().written_entries == 1
            _turn(c, "unwritten", 300, seed=2)
            c.set_pressure("warning")
            r = _wait_receipt(c, "pressure_trim")
            assert (r["bank_entries_evicted"], r["bank_unwritten_kept"]) == (1, 1), r
            assert r["bank_unwritten_dropped"] == 0
            assert _sessions(c)["unwritten"].state == "resident-dirty"
            c.set_pressure("auto")
            back = _turn(c, "on-ssd", 8, seed=3)
            assert back.usage["cache_source"] == "ssd" and back.usage["cached_tokens"] >= 200
            assert back.usage["recomputed_tokens"] == 0, back.usage

            released = c.release("unwritten")
            assert released.written_out_entries == 1, released
            again = _turn(c, "unwritten", 8, seed=4)
            assert again.usage["cache_source"] == "ssd", again.usage
            assert again.usage["cached_tokens"] >= 300 and again.usage["recomputed_tokens"] == 0

            _turn(c, "dropped", 150, seed=5)
            c.set_pressure("critical")
            r = _wait_receipt(c, "pressure_trim", n=2)
            assert r["level"] == "critical" and r["bank_unwritten_dropped"] >= 1, r
            assert r["bytes_after"] == 0
            assert _sessions(c)["dropped"].state == "gone"
    finally:
        s.stop()


def test_two_conversations_that_share_a_system_prompt_store_its_checkpoint_once(stripping):
    """qwen3_5: the checkpoint where the system prompt ends stands inside a block. The first
    conversation stores it on SSD beside its blocks (an anchor, content-addressed by the
    chain); a second conversation with the same system prompt, the first released from RAM,
    restores from SSD up to exactly there and answers as mlx-lm does; both records name the
    one stored anchor."""
    from kvbank.contracts.store_layout import StoreReader

    model, s = stripping("qwen3_5")
    ref = Reference(model)
    system = {"role": "system", "content": "You are a careful coding agent. " * 9 + "Be brief."}
    with s.client() as c:
        first = [system, {"role": "user", "content": "Read the parser."}]
        a = c.generate(messages=first, max_tokens=8)
        s.wait_durable(a.usage["session_id"])
        c.release(a.usage["session_id"])
        second = [system, {"role": "user", "content": "Now the lexer, please."}]
        prompt = c.render(messages=second, max_tokens=MAX_TOKENS)
        shared = ref.prompts.shared_end(second, prompt)
        assert shared % 16, "the system prompt must end inside a block for this test"
        # what the first conversation's read left at the anchor: one forward up to it
        ref.tokens, ref.lineage = list(prompt), [(0, shared)]
        b = c.generate(messages=second, max_tokens=MAX_TOKENS, logprobs=True)
        assert (b.usage["cache_source"], b.usage["cached_tokens"]) == ("ssd", shared)
        _check(ref, b, prompt, ref.prompts.checkpoints(second, prompt), True, "from anchor")
        s.wait_durable(b.usage["session_id"])
        store = StoreReader(s.layout.store_dir, readonly=True)
        try:
            anchors = [store.get_session("", t.usage["session_id"])[0].anchors
                       for t in (a, b)]
        finally:
            store.close()
    # [id, start, tokens]: each record also names its own prompt's end before the generation
    # prompt; the system prompt's end is one stored anchor, named by both
    at_shared = [[a for a in each if a[1] + a[2] == shared] for each in anchors]
    assert at_shared[0] == at_shared[1] and len(at_shared[0]) == 1


@pytest.mark.parametrize("arch", matrix(("qwen3_5", "gpt_oss"),  # recurrent state; windows
                                         keep=("qwen3_5",)))
def test_a_stripped_history_comes_back_from_ssd_at_the_previous_prompts_end(arch, stripping):
    """A hybrid and a sliding-window model with the reasoning-stripping template, the
    conversation released from RAM after every turn: the checkpoint before each prompt's
    generation prompt stands inside a block, and went to SSD as an anchor, so each next turn
    restores up to there from SSD and answers as mlx-lm does."""
    model, s = stripping(arch)
    ref = Reference(model)
    messages = [{"role": "system", "content": "Think it through, then answer."},
                {"role": "user", "content": "Which file holds the parser?"}]
    gen = len(ref.prompts.encode("<|im_start|>assistant\n<think>\n"))
    with s.client() as c:
        for turn in range(3):
            prompt = c.render(messages=messages, max_tokens=MAX_TOKENS)
            got = c.generate(messages=messages, max_tokens=MAX_TOKENS, logprobs=True)
            if turn:
                assert got.usage["cache_source"] == "ssd", got.usage
                assert got.usage["cached_tokens"] >= last_prompt - gen, got.usage
            _check(ref, got, prompt, ref.prompts.checkpoints(messages, prompt), True,
                   f"turn {turn}")
            last_prompt = len(prompt)
            session = got.usage["session_id"]
            s.wait_durable(session)
            c.release(session)
            messages += [{"role": "assistant", "content": got.text or "."},
                         {"role": "user", "content": "And the tests?"}]


TIERS = ("ram", "ssd after a release", "ssd after kill -9")
TOOL_TURNS = 8  # each tier at least twice (RAM, SSD, kill -9), the new query at the seventh, one after
TOP = 5  # a scripted model's chosen token has logprob 0.0 in float32, whatever its context:
         # its alternatives' logprobs are what a wrong KV moves


def _tops_agree(got: list[list[float]], want: list[list[float]], where: str) -> None:
    """The `top_logprobs` of each answer token (values, most likely first) against mlx-lm's."""
    assert got and len(got) <= len(want), (where, len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == TOP, (where, i, g)
        diff = np.abs(np.asarray(g) - np.asarray(w)).max()
        assert diff < 1e-4, f"{where}: token {i}'s top logprobs off by {diff:.2g}"


@pytest.fixture(scope="module")
def gpt_oss_tools(cache_dir, tmp_path_factory):
    """(model, stack): gpt-oss's scripted model (it calls `run` every turn, in harmony) behind
    a stack with the shim, shared by the three APIs' conversations (each its own system
    prompt, so none finds another's in cache)."""
    from kvbank.testing.family_models import scripted_model

    model = scripted_model("gpt_oss", cache_dir=cache_dir)
    s = start_stack(model, tmp_path_factory.mktemp("gpt-oss-tools"), cache_dir=cache_dir)
    yield model, s
    s.stop()


@pytest.mark.parametrize("api", matrix(("chat", "responses", "anthropic"), keep=("chat",)))
def test_a_gpt_oss_tool_loop_answers_as_mlx_lm_from_scratch(api, gpt_oss_tools):
    """gpt-oss's published template, eight requests of an agent's tool loop (reasoning in the
    analysis channel, a call in the commentary channel, its result, a new query at the
    seventh), each sending the history back as the API returned it; before each returning
    turn the conversation stays in RAM, is released to SSD, or the worker is killed with -9,
    in turn. Each answer's tokens (and, on the chat API, each token's logprob) equal mlx-lm's
    from scratch on the prompt ids the worker read, and each turn reads the whole previous
    one from cache. The Responses and Anthropic APIs carry no logprobs of a call: their last
    request is sent again as the shim sends it to the router, logprobs asked, so the KV all
    eight turns left is checked to 1e-4 as well."""
    import uuid

    from kvbank.client import Turn
    from kvbank.router.validation import validate
    from kvbank.testing.family_models import CALL, FAMILIES, REASONING
    from tests.families import MAX_TOKENS as LOOP_TOKENS, generate_request, loop

    model, s = gpt_oss_tools
    ref = Reference(model, max_tokens=LOOP_TOKENS, top_n=TOP)
    tiers = ("first",) + tuple(TIERS[i % 3] for i in range(TOOL_TURNS - 1))
    state = {"session": None, "previous": 0}

    def marks(body: dict, prompt: list[int]) -> list[int]:
        """Where the worker checkpointed this prompt (the router's own computation)."""
        v = validate(generate_request(api, body), vocab_size=ref.prompts.vocab_size)
        return ref.prompts.checkpoints(list(v.messages), prompt, tools=list(v.tools) or None,
                                       template=v.template)

    def after(i: int, step) -> None:
        where = f"{api} turn {i} ({tiers[i]})"
        k = step.kvbank
        assert k["cache_source"] == ("none" if i == 0 else tiers[i].split()[0]), (where, k)
        assert step.cached >= state["previous"], (where, step)  # the whole previous turn
        # (a first turn may find another conversation's harmony preamble, and not use it)
        assert k["recomputed_tokens"] == 0 and (i == 0 or k["prefix_lost_tokens"] == 0), k
        assert step.calls == [CALL] and not step.text.strip(), (where, step)
        assert step.reasoning.strip() == REASONING, (where, step)
        session = state["session"] = k["session_id"]
        with s.client() as c:
            ids = list(c.get_session(session).token_ids)
        prompt, answer = ids[:step.prompt], ids[step.prompt:]
        assert prompt and answer and answer[-1] in ref.eos, (where, len(ids), step)
        got = Turn("", [t for t in answer if t not in ref.eos], "",
                   {"cached_tokens": step.cached}, step.logprobs or [])
        if api == "chat":
            assert len(got.logprobs) >= len(got.token_ids), (where, len(got.logprobs))
        _check(ref, got, prompt, marks(step.body, prompt), True, where,
               unsplit=i + 1 == TOOL_TURNS)  # one whole forward of the longest prompt
        if api == "chat":
            _tops_agree(step.tops, ref.tops, where)
        state["previous"] = len(ids)
        if i + 1 < TOOL_TURNS:
            with s.client() as c:
                send_back(s, c, session, tiers[i + 1])

    system = f"You are a coding agent. [{uuid.uuid4().hex[:8]}]"
    steps = loop(s, FAMILIES["gpt_oss"], api, requests=TOOL_TURNS, system=system, after=after,
                 **({"logprobs": True, "top_logprobs": TOP} if api == "chat" else {}))
    assert len(steps) == TOOL_TURNS
    if api == "chat":
        return
    last = steps[-1]
    req = generate_request(api, last.body)
    req.sampling.logprobs, req.sampling.top_logprobs = True, TOP
    with s.client() as c:
        ids, lps, tops, usage = [], [], [], None
        for ev in c.generation.Generate(req, timeout=120):
            ids.extend(ev.token_ids)
            lps.extend(lp.logprob for lp in ev.logprobs)
            tops.extend([t.logprob for t in lp.top] for lp in ev.logprobs)
            if ev.HasField("usage"):
                usage = ev.usage
    prompt = list(ref.tokens[:last.prompt])
    assert usage.prompt_tokens == len(prompt) and usage.cached_tokens > 0, usage
    got = Turn("", ids, "", {"cached_tokens": usage.cached_tokens}, lps)
    assert len(lps) >= len(ids) > 0
    _check(ref, got, prompt, marks(last.body, prompt), True, f"{api}: the last request again")
    _tops_agree(tops, ref.tops, f"{api}: the last request again")
