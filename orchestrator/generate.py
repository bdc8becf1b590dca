"""`dpfleet generate`'s core: text sampled from a causal language model a run released.

Generation is post-processing of the released model: it reads the model,
its model folder's tokenizer and the prompt given, nothing of the run's
private data. The text leaves through the release boundary ("generated
text").
"""

from __future__ import annotations

import secrets
from pathlib import Path

import torch

import orchestrator.release as release_boundary
from orchestrator.errors import UsageError
from orchestrator.export import load_released
from workers.pretrained import load_tokenizer


def sampling_options(max_new_tokens: int, temperature: float, pad_token_id: int, top_k: int | None = None,
                     top_p: float | None = None) -> dict:
    """transformers' ``generate`` options: up to ``max_new_tokens`` tokens, sampled at ``temperature`` (greedy at
    0) from the ``top_k`` likeliest tokens and the fewest whose probabilities reach ``top_p``, where given; the
    model folder's generation_config.json gives what is not."""
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1 (got {max_new_tokens})")
    if not temperature >= 0:
        raise UsageError(f"--temperature must be >= 0, 0 for the likeliest token each time (got {temperature})")
    if top_k is not None and top_k < 1:
        raise UsageError(f"--top-k must be >= 1 (got {top_k})")
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1] (got {top_p})")
    narrowed = {name: value for name, value in (("top_k", top_k), ("top_p", top_p)) if value is not None}
    if temperature == 0 and narrowed:
        flags = ", ".join("--" + name.replace("_", "-") for name in narrowed)
        raise UsageError(f"--temperature 0 takes the likeliest token each time, so {flags} would change nothing: "
                         "drop it, or sample with a temperature above 0")
    sampling = ({"do_sample": True, "temperature": temperature, **narrowed} if temperature > 0
                else {"do_sample": False})
    return {"max_new_tokens": max_new_tokens, "pad_token_id": pad_token_id, **sampling}


def generated_text(run_or_export: str | Path, prompt: str, max_new_tokens: int = 20, temperature: float = 1.0,
                   seed: int | None = None, top_k: int | None = None, top_p: float | None = None) -> str:
    """The prompt and the tokens a causal-lm run's released model samples after it (transformers' ``generate``,
    with ``sampling_options``), as its model folder's tokenizer decodes them, special tokens left out.

    ``seed`` makes the sampling reproducible without reseeding the
    caller's random generator; without one it draws fresh randomness each
    call.
    """
    released = load_released(run_or_export)
    task = released.description["spec"]["task"] if released.pretrained else None
    if task != "causal-lm":
        raise UsageError(f"dpfleet generate samples from a pretrained causal language model (model = {{ hf, task = "
                         f"\"causal-lm\" }}); {str(run_or_export)!r} holds a model of task {task or 'other'!r}: "
                         "dpfleet predict classifies with it")
    tokenizer = load_tokenizer(released.tokenizer_folder)
    encoded = tokenizer(prompt, return_tensors="pt")
    if encoded["input_ids"].shape[1] == 0:
        raise UsageError("--prompt gives no tokens; give the text to continue")
    options = sampling_options(max_new_tokens, temperature, tokenizer.pad_token_id, top_k, top_p)
    model = released.user_model
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(secrets.randbits(63) if seed is None else seed)
        tokens = model.generate(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"], **options)
    text = tokenizer.decode(tokens[0], skip_special_tokens=True)
    return release_boundary.record("generated text", {"text": text})["text"]
