"""Prompts of an exact token count for the target model, cut from real text (WikiText-2 by default).

What "N tokens" means is what the server will count as `usage.prompt_tokens`:
- /v1/completions: `len(tokenizer.encode(text))` with the tokenizer's special tokens (a BOS, if it adds one);
- /v1/chat/completions: the length of the whole templated prompt - the model's chat template applied to one
  user message (no system message, so a template's default system prompt counts too) with the assistant
  turn opened. The template's own tokens are part of N, so N below that minimum cannot be met: such prompts
  get a one-token message and their real (larger) count is reported.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetcore.data import WIKITEXT2_TEST

DEFAULT_TEXT = WIKITEXT2_TEST
"""Text the prompts are cut from when none is given: WikiText-2 test, bundled with the package."""
_MAX_STARTS = 8  # windows tried per prompt before giving up
_MAX_FIXES = 6  # length corrections per window (a decode/encode round trip can merge or split tokens)


class PromptError(ValueError):
    """No text of the requested token count could be built."""


@dataclass(frozen=True)
class Prompt:
    """A prompt text and the number of tokens the server will count for it."""

    text: str
    num_tokens: int


class TargetTokenizer:
    """The target model's Hugging Face tokenizer, counting tokens the way an OpenAI-compatible server does."""

    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer
        self.has_chat_template = bool(getattr(hf_tokenizer, "chat_template", None))

    @classmethod
    @functools.lru_cache(maxsize=4)  # one load per process and path (tests run the CLI more than once)
    def load(cls, path: str | None = None) -> TargetTokenizer:
        """`path`: a tokenizer or model directory, or a .gguf file; None: hetserve's bundled default model."""
        from transformers import AutoTokenizer

        try:
            if path is None:
                from gpu_model.loader import resolve_model_dir

                return cls(AutoTokenizer.from_pretrained(resolve_model_dir(None)))
            p = Path(path).expanduser()
            if p.is_file() and p.suffix == ".gguf":
                return cls(AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name))
            if not p.is_dir():
                raise PromptError(f"tokenizer {path}: not a directory or .gguf file (nothing is downloaded)")
            return cls(AutoTokenizer.from_pretrained(p))
        except (OSError, ValueError) as exc:
            if isinstance(exc, PromptError):
                raise
            raise PromptError(f"cannot load tokenizer {path or '(bundled model)'}: {exc}") from exc

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` without special tokens."""
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        # no clean-up: it would rewrite " ." as "." and change the count on re-encoding
        return self._tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def chat_text(self, content: str) -> str:
        """The templated prompt for one user message, assistant turn opened."""
        return self._tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)

    def count(self, text: str, chat: bool = False) -> int:
        """Prompt tokens the server counts for `text` sent as a completion prompt or as one chat message."""
        if chat:
            if not self.has_chat_template:
                raise PromptError("the tokenizer has no chat template; use the completions API")
            return len(self._tok.encode(self.chat_text(text), add_special_tokens=False))
        return len(self._tok.encode(text, add_special_tokens=True))

    def count_output(self, text: str) -> int:
        """Tokens in generated text (used only when a server reports no usage)."""
        return len(self._tok.encode(text, add_special_tokens=False))


class PromptBuilder:
    """Cuts windows of real text whose token count, as the server counts it, is exactly N.

    With `shared_prefix_tokens` P, every prompt longer than the prefix starts with the same P tokens
    of text and a blank line (a system prompt or document every request shares, which a server's
    prefix cache can keep) and goes on with its own text; N includes them. Shorter prompts are sent
    without it."""

    def __init__(self, tokenizer: TargetTokenizer, corpus_text: str, chat: bool = False, seed: int = 0,
                 shared_prefix_tokens: int = 0):
        ids = tokenizer.encode_plain(corpus_text)
        if len(ids) < 64:
            raise PromptError(f"the prompt text has only {len(ids)} tokens; give a longer text file")
        self._ids = np.asarray(ids, dtype=np.int64)  # [num_corpus_tokens]
        self._tok, self.chat, self.seed = tokenizer, chat, seed
        self.min_tokens = tokenizer.count(tokenizer.decode(self._ids[:1]), chat)  # template/BOS + one token
        self.prefix, self._prefix_min = "", self.min_tokens
        if shared_prefix_tokens > 0:  # from its own place (no prompt index is 2**31); a blank line keeps the
            start = int(np.random.default_rng([seed, 2**31]).integers(len(ids)))  # text after it from merging in
            self.prefix = self._window(start, shared_prefix_tokens) + "\n\n"
            self._prefix_min = tokenizer.count(self.prefix + tokenizer.decode(self._ids[:1]), chat)  # and one token

    def _window(self, start: int, length: int) -> str:
        n = len(self._ids)
        idx = (start + np.arange(length)) % n  # wrap around: prompts may be longer than the text
        return self._tok.decode(self._ids[idx])

    def build(self, num_tokens: int, index: int = 0) -> Prompt:
        """A prompt of exactly `num_tokens` (or the one-token minimum, if that is larger); `index` picks
        where in the text it starts, so different requests get different text."""
        if num_tokens <= self.min_tokens:
            return Prompt(self._window(index, 1), self.min_tokens)
        lead, least = (self.prefix, self._prefix_min) if num_tokens >= self._prefix_min else ("", self.min_tokens)
        rng = np.random.default_rng([self.seed, index])
        length = num_tokens - (least - 1)  # text tokens, before round-trip corrections
        for _ in range(_MAX_STARTS):
            start, k = int(rng.integers(len(self._ids))), length
            for _ in range(_MAX_FIXES):
                text = lead + self._window(start, k)
                n = self._tok.count(text, self.chat)
                if n == num_tokens:
                    return Prompt(text, n)
                k += num_tokens - n
                if k < 1:
                    break
        raise PromptError(f"no window of the text encodes to exactly {num_tokens} tokens")

    def build_all(self, lengths: list[int], progress: bool = False) -> list[Prompt]:
        """One prompt per requested length; prompt i starts at a position drawn from (seed, i)."""
        from tqdm import tqdm

        return [self.build(n, i) for i, n in enumerate(tqdm(lengths, desc="prompts", unit="prompt",
                                                             disable=not progress, leave=False))]
