"""The tiny models coding agents run on in tests and in `kvbank bench agents`.

A random model knows no tool format and never stops: `with_tools_template` gives the tiny
llama a Qwen-style tools template (kvbank/templates/qwen_tools.jinja), so mlx-lm gives it a
tool parser and the worker can force calls; `says_done` makes its head answer "Done" and end
at any temperature, so real agent CLIs (which sample at their own temperature and give up on
an answer that never ends) finish every turn. All of it is deterministic: one seed, one folder,
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


def says_done(src: Path, out: Path, context: int = CONTEXT) -> Path:
    """`src` with a `context`-token context and a head that answers "Done" and ends, whatever
    the temperature: one direction of every embedding is constant and the head's "Done" row
    reads it; a second is set in "Done"'s embedding alone, and the end-of-turn row reads it
    twice as hard. After any token the model writes "Done"; after "Done", the end."""
    import mlx.core as mx
    import numpy as np

    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    config.update(max_position_embeddings=context, tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config))
    tok = json.loads((out / "tokenizer_config.json").read_text())
    tok["model_max_length"] = context
    (out / "tokenizer_config.json").write_text(json.dumps(tok))
    done = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]["Done"]
    w = {k: np.array(v) for k, v in mx.load(str(out / "model.safetensors")).items()}
    embed = w["model.embed_tokens.weight"]
    embed[:, :2] = 0.0
    embed[:, 0] = 1.0
    embed[done, 1] = 1.0
    head = np.zeros_like(embed)
    scale = np.sqrt(embed.shape[1])  # what RMSNorm leaves of a unit direction
    head[done, 0] = 40.0 * scale
    head[config["eos_token_id"], 1] = 80.0 * scale
    w["lm_head.weight"] = head
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in w.items()},
                        metadata={"format": "mlx"})
    return out


def agent_model(root: Path, cache_dir: Path | None = None, seed: int = 0) -> Path:
    """The model the agent recordings were made on, built under `root` (which must not hold
    one yet): the tiny llama of `seed`, the tools template, the "Done" head."""
    from kvbank.models import make_tiny_model

    tiny = make_tiny_model(Path(root) / "tiny", seed=seed, cache_dir=cache_dir)
    return says_done(with_tools_template(tiny, Path(root) / "tools"), Path(root) / "model")
