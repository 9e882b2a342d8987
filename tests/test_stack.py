"""The whole path, as a user drives it: real router, worker and coldstore processes."""

from __future__ import annotations

import grpc

from tests.conftest import rpc_error


def _ask(c, session, text, **kw):
    kw.setdefault("max_tokens", 12)
    return c.generate(session_id=session, messages=[{"role": "user", "content": text}],
                      append=True, **kw)


def test_second_turn_restores_the_whole_first_turn_from_ram(stack):
    with stack.client() as c:
        t1 = _ask(c, "agent-a", "List three prime numbers.")
        t2 = _ask(c, "agent-a", "Now three even ones.")
        u1, u2 = t1.usage, t2.usage
        assert u1["cache_source"] == "none" and u1["cached_tokens"] == 0
        assert u2["cache_source"] == "ram"
        assert u2["cached_tokens"] >= u1["prompt_tokens"] + u1["completion_tokens"]
        assert u2["recomputed_tokens"] == 0
        assert u1["durable"] and u2["durable"]

        # The same prompt with the cache off gives the same answer, greedy and sampled.
        history = list(c.get_session("agent-a").token_ids)
        prompt2 = history[: u2["prompt_tokens"]]
        cold = c.generate(token_ids=prompt2, max_tokens=12, no_cache=True)
        assert cold.usage["cached_tokens"] == 0
        assert cold.token_ids == t2.token_ids

        warm = c.generate(token_ids=prompt2, max_tokens=12, temperature=1.0, seed=7)
        assert warm.usage["cached_tokens"] > 0
        cold = c.generate(token_ids=prompt2, max_tokens=12, temperature=1.0, seed=7, no_cache=True)
        assert warm.token_ids == cold.token_ids
        assert len(set(warm.token_ids)) > 1  # sampled text, not one repeated token


def test_committed_history_is_prompt_plus_completion_of_every_turn(module_stack):
    with module_stack.client() as c:
        t1 = _ask(c, "hist", "Say something.")
        s1 = c.get_session("hist")
        assert s1.token_count == t1.usage["prompt_tokens"] + t1.usage["completion_tokens"]
        t2 = _ask(c, "hist", "And more.")
        s2 = c.get_session("hist")
        assert list(s2.token_ids[: s1.token_count]) == list(s1.token_ids)
        assert s2.token_count == t2.usage["prompt_tokens"] + t2.usage["completion_tokens"]


def test_worker_killed_between_turns_restores_from_ssd(stack):
    with stack.client() as c:
        _ask(c, "survivor", "Remember the number 42.", max_tokens=20)
    before = stack.wait_durable("survivor")
    assert before.durable_tokens > 16  # more than one block reached LMDB

    old = stack.kill9("worker")
    stack.wait_restarted("worker", old)

    with stack.client() as c:
        after_restart = c.get_session("survivor")
        assert list(after_restart.token_ids) == list(before.token_ids)
        t2 = _ask(c, "survivor", "What was the number?")
        assert t2.usage["cache_source"] == "ssd"
        assert t2.usage["cached_tokens"] >= before.durable_tokens
        assert t2.usage["recomputed_tokens"] == 0
        s = c.get_session("survivor")
        assert list(s.token_ids[: before.token_count]) == list(before.token_ids)


def test_bad_inputs_get_a_status_and_a_sentence(module_stack):
    with module_stack.client() as c:
        cases = [
            (lambda: c.generate(session_id="x", prompt="", max_tokens=4),
             grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
            (lambda: c.generate(session_id="x", prompt="hi", max_tokens=0),
             grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be > 0"),
            (lambda: c.generate(session_id="x", prompt="hi", max_tokens=-3),
             grpc.StatusCode.INVALID_ARGUMENT, "given -3"),
            (lambda: c.generate(session_id="x", token_ids=[5] * 3000, max_tokens=4),
             grpc.StatusCode.INVALID_ARGUMENT, "exceed the model's context"),
            (lambda: c.generate(session_id="x", messages=[{"role": "wizard", "content": "hi"}],
                                max_tokens=4),
             grpc.StatusCode.INVALID_ARGUMENT, "role must be one of"),
            (lambda: c.generate(session_id="x", messages=[], max_tokens=4),
             grpc.StatusCode.INVALID_ARGUMENT, "chat.messages is empty"),
            (lambda: c.generate(prompt="hi", append=True, max_tokens=4),
             grpc.StatusCode.INVALID_ARGUMENT, "append needs a session_id"),
            (lambda: c.generate(token_ids=[10**9], max_tokens=4),
             grpc.StatusCode.INVALID_ARGUMENT, "vocabulary size"),
            (lambda: c.get_session("never-was"), grpc.StatusCode.NOT_FOUND, "no session"),
        ]
        for call, code, words in cases:
            err = rpc_error(call)
            assert err.code() == code, (words, err.details())
            assert words in err.details(), err.details()
        # Nothing else was affected: the stack still answers, and no session was created.
        assert _ask(c, "after-bad-input", "Still there?", max_tokens=4).usage["durable"]
        assert rpc_error(lambda: c.get_session("x")).code() == grpc.StatusCode.NOT_FOUND
    assert module_stack.proc.poll() is None


def test_ctrl_c_stops_all_three(stack):
    pids = [stack.pid(n) for n in ("router", "worker", "coldstore")]
    assert stack.stop() == 0
    import os

    for pid in pids:
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive, f"pid {pid} still running after Ctrl-C"


def test_restore_through_the_coldstore_gives_the_same_answer(tiny_model, tmp_path, cache_dir):
    """--restore-via coldstore: SSD KV fetched over ZeroMQ, not read from the map."""
    from tests.conftest import start_stack

    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir,
                    extra=["--restore-via", "coldstore"], shim=False)
    try:
        with s.client() as c:
            _ask(c, "via", "Remember the number 42.", max_tokens=20)
            before = s.wait_durable("via")
            c.release("via")
            prompt = list(before.token_ids) + [200, 201, 202]
            warm = c.generate(session_id="via", token_ids=prompt, max_tokens=8)
            assert warm.usage["cache_source"] == "ssd"
            assert warm.usage["cached_tokens"] == before.token_count
            cold = c.generate(token_ids=prompt, max_tokens=8, no_cache=True)
            assert warm.token_ids == cold.token_ids
    finally:
        s.stop()


def test_a_cancelled_turn_gives_its_conversation_back_to_ram(module_stack):
    """A returning turn takes its conversation's KV with it while it runs; when its client
    goes away mid-answer, the conversation is back in RAM as it was, and the next turn reads
    all of it from there.

    The answer is as long as the context allows, but on a loaded machine it may still end
    before the cancel reaches the worker: then that turn was answered and committed (as it
    should be), and the test starts over with a new conversation until a cancel arrives
    while its turn runs, which is what it checks."""
    from kvbank.v1 import api_pb2
    from tests.waiting import wait_until

    with module_stack.client() as c:
        for attempt in range(5):
            session = f"agent-c{attempt}"
            t1 = _ask(c, session, "List three prime numbers.")
            history = len(c.get_session(session).token_ids)
            req = api_pb2.GenerateRequest(session_id=session, append=True,
                                          max_tokens=1900)  # the context is 2,048
            req.chat.messages.add(role="user", content="Now count to 500.")
            call = c.generation.Generate(req)  # the stub's own call, so the test can cancel it
            next(ev for ev in call if ev.token_ids)  # it is answering
            call.cancel()
            wait_until(lambda: c.status().running_requests == 0, "the cancelled turn to leave")
            if len(c.get_session(session).token_ids) == history:  # not committed
                break
        else:
            raise AssertionError("in 5 attempts, every turn ended before its cancel arrived")
        t3 = _ask(c, session, "Now three even ones.")
        assert t3.usage["cache_source"] == "ram", t3.usage
        assert t3.usage["cached_tokens"] >= history - 1 >= t1.usage["prompt_tokens"]
        assert t3.usage["recomputed_tokens"] == 0


def test_a_data_dir_too_deep_for_a_socket_path_still_serves(tiny_model, tmp_path, cache_dir):
    """A Unix socket's path holds 107 bytes: under a deep --data-dir the sockets go to a
    directory of their own in the system's temporary one, and the stack serves as usual."""
    from tests.conftest import start_stack

    deep = tmp_path / ("a-long-directory-name-" * 4) / "data"
    s = start_stack(tiny_model, deep, cache_dir=cache_dir, shim=False)
    try:
        assert s.layout.sockets_dir != s.layout.run_dir
        assert len(s.layout.coldstore_address) <= 110
        with s.client() as c:
            first = c.generate(session_id="deep", prompt="Hello there", max_tokens=2,
                               append=True)
            s.wait_durable("deep")
            assert c.generate(session_id="deep", prompt=" again", max_tokens=2,
                              append=True).usage["cached_tokens"] >= \
                first.usage["prompt_tokens"]
    finally:
        s.stop()


def test_a_conversation_released_to_ssd_restores_its_partial_last_block_too(module_stack):
    """A release writes a conversation's partial last block (its tail) with the rest; the
    same request sent again (shorter than the history its answer made) restores every prompt
    token from SSD, the tail's included, as RAM would, and answers as a recomputation does.
    Named and anonymous alike."""
    block = 16  # start_stack's --block-tokens
    with module_stack.client() as c:
        for seed, name in ((3, "tail-named"), (4, "")):
            prompt = [1000 + (97 * i + 131 * seed) % 20000 for i in range(3 * block + 5)]
            first = c.generate(session_id=name, token_ids=prompt, max_tokens=4)
            sid = first.usage["session_id"]
            module_stack.wait_durable(sid)
            assert c.release(sid).released_entries == 1
            assert c.get_session(sid).state == "cold"
            again = c.generate(session_id=name, token_ids=prompt, max_tokens=4, logprobs=True)
            assert again.usage["cache_source"] == "ssd", again.usage
            assert again.usage["cached_tokens"] == len(prompt) - 1, again.usage  # not 3 blocks
            assert again.usage["recomputed_tokens"] == 0
            cold = c.generate(token_ids=prompt, max_tokens=4, logprobs=True, no_cache=True)
            assert again.token_ids == cold.token_ids == first.token_ids
            assert max(abs(a - b) for a, b in zip(again.logprobs, cold.logprobs)) < 1e-4


def test_a_supervisor_killed_by_sigkill_leaves_no_process_behind(stack):
    """`kvbank up` killed without a chance to stop its children (an OOM kill, a caller's
    kill): each child gets SIGTERM from the kernel and stops on its own."""
    import os
    import signal

    from tests.waiting import wait_until

    pids = [stack.pid(n) for n in ("shim", "router", "worker", "coldstore")]
    os.kill(stack.proc.pid, signal.SIGKILL)
    stack.proc.wait()

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a child that exited but is not reaped yet (init reaps it)
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    wait_until(lambda: all(gone(p) for p in pids), "every child of the killed supervisor to end")
