"""Long-context retrieval tasks for `hetserve eval --task`, generated in code and answered by
greedy generation through the serving path (prefill, then one token at a time through the KV
store and the attention under test).

    passkey  a 5-digit pass key hidden at a random depth in repeated filler sentences
             (Landmark Attention / MagicPIG's passkey test); correct when the answer holds it
    niah     RULER's multi-key needle in a haystack: four "special magic number for <word>"
             needles in the haystack text (WikiText-2), one of them asked for; correct when the
             answer holds it
    cwe      RULER's common-words extraction: a numbered list of the haystack's words in which
             five come up to 30 times (a third of the list at most) and the rest 3 times; the
             score is the share of the five in the answer

Each prompt is a chat: the question in the user turn, the answer's first words ("The pass key
is") already in the assistant turn, so a small instruct model answers in the expected form.
"""
from __future__ import annotations

import itertools
import random
import re
from dataclasses import asdict, dataclass

import torch

from cpu_attn.calibrate import SPARSE_FRACTION
from cpu_attn.kv_store import make_store
from cpu_attn.magicpig import MagicPig
from cpu_attn.layered_worker import LayeredAttentionWorker
from cpu_attn.worker import AttentionWorker, ChunkLayout
from gpu_model.worker import ModelWorker

TASKS = ("passkey", "niah", "cwe")
_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass(frozen=True)
class Sample:
    prompt: list[int]
    answers: tuple[str, ...]  # what a correct answer contains
    max_new_tokens: int

    def score(self, text: str) -> float:
        """Share of `answers` found in the generated text (as whole words)."""
        words = set(re.findall(r"\w+", text.lower()))
        return sum(a.lower() in words for a in self.answers) / len(self.answers)


def _chat(tok, question: str, answer_start: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": question}])
    return ids + tok.encode(answer_start)[len(tok.encode("")):]


def _fit(tok, build, context_tokens: int) -> list[int]:
    """The prompt from `build(n)` with the largest n that stays within context_tokens (bisection)."""
    lo, hi = 1, context_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(build(mid)) <= context_tokens:
            lo = mid
        else:
            hi = mid - 1
    return build(lo)


def passkey(tok, context_tokens: int, rng: random.Random, **_) -> Sample:
    key = str(rng.randint(10000, 99999))
    depth = rng.random()
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "

    def build(n: int) -> list[int]:
        at = round(depth * n)
        hay = _FILLER * at + needle + _FILLER * (n - at)
        question = ("There is an important piece of information hidden inside a lot of irrelevant text. "
                    f"Find it and memorize it.\n\n{hay}\n\nWhat is the pass key?")
        return _chat(tok, question, "The pass key is")

    return Sample(_fit(tok, build, context_tokens), (key,), 8)


def niah(tok, context_tokens: int, rng: random.Random, haystack: list[str], **_) -> Sample:
    words = rng.sample(_WORDS, 4)
    values = [str(rng.randint(1000000, 9999999)) for _ in words]
    depths = sorted(rng.random() for _ in words)
    asked = rng.randrange(len(words))
    first = rng.randrange(len(haystack))
    sentences = haystack[first:] + haystack[:first]

    def build(n: int) -> list[int]:
        parts = list(sentences[:n])
        for word, value, depth in reversed(list(zip(words, values, depths))):
            parts.insert(round(depth * n), f"One of the special magic numbers for {word} is: {value}.")
        question = (f"Some special magic numbers are hidden within the following text. Memorize them.\n\n{' '.join(parts)}"
                    f"\n\nWhat is the special magic number for {words[asked]} mentioned in the text?")
        return _chat(tok, question, f"The special magic number for {words[asked]} mentioned in the text is")

    return Sample(_fit(tok, build, context_tokens), (values[asked],), 12)


def cwe(tok, context_tokens: int, rng: random.Random, haystack: list[str], num_common: int = 5, **_) -> Sample:
    vocab = sorted({w.lower() for line in haystack for w in line.split() if w.isalpha() and 4 <= len(w) <= 10})
    vocab = rng.sample(vocab, len(vocab))
    common, rare = vocab[:num_common], vocab[num_common:]

    def build(n: int) -> list[int]:  # n list items; the common words take up to a third, 30 times at most
        times = max(4, min(30, n // (3 * num_common)))
        items = common * times + [w for w in rare[:max(0, n - num_common * times) // 3 + 1] for _ in range(3)]
        items = items[:max(n, num_common * times)]
        random.Random(n).shuffle(items)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        question = ("Below is a numbered list of words. In these words, some appear more often than others. "
                    f"Memorize the ones that appear most often.\n{listing}\n"
                    f"Question: What are the {num_common} most common words in the above list?")
        return _chat(tok, question, f"Answer: The top {num_common} words that appear most often in the list are:")

    return Sample(_fit(tok, build, context_tokens), tuple(common), 8 * num_common)


def make_samples(task: str, tok, context_tokens: int, num_samples: int, haystack: list[str], seed: int = 0) -> list[Sample]:
    build = {"passkey": passkey, "niah": niah, "cwe": cwe}[task]
    rng = random.Random(seed)
    return [build(tok, context_tokens, rng, haystack=haystack) for _ in range(num_samples)]


def sentences(text: str) -> list[str]:
    """WikiText-2 as a haystack: its sentences, headings and blank lines dropped."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("=")]
    return [s.strip() for ln in lines for s in re.split(r"(?<=[.!?]) ", ln) if len(s.split()) > 3]


@torch.inference_mode()
def generate(model, workers: dict[str, AttentionWorker], samples: list[Sample], eos: frozenset[int],
             layered: dict | None = None) -> dict[str, list[list[int]]]:
    """Greedy answers to every sample under each attention worker (stores of equal geometry).

    The prompts are prefilled once: prefill attention reads the chunk's own k, v, so the first
    worker computes it and the others only store the KV in their formats. Then each worker
    decodes its own answers, all samples in one batch. `layered`: name -> LayeredRun of the workers
    with layered KV sparsity (evaluation/layered.py), which attend the prompt themselves (that
    scores its tokens and evicts at its end) and lay out their chunks with their own rows."""
    layered = layered or {}
    first_worker, *others = workers.values()
    coder = next((w.sparse.coder() for w in workers.values() if isinstance(w.sparse, MagicPig)), None)
    forward = ModelWorker(model, coder).forward  # key centers come from the shared prefill
    bs = first_worker.store.block_size
    tables, used = [], 0
    for s in samples:
        n = -(-(len(s.prompt) + s.max_new_tokens) // bs)
        tables.append(tuple(range(used, used + n)))
        used += n
    if used > first_worker.store.num_blocks:
        raise ValueError(f"the samples need {used} KV blocks, the store has {first_worker.store.num_blocks}")

    def prefill(layer, q, k, v, codes):
        for w in others:
            if isinstance(w, LayeredAttentionWorker):
                w.attend(layer, q, k, v)
            else:
                w.append(layer, k, v, None if codes is None else codes[1])
        return first_worker.attend(layer, q, k, v, codes)

    layout = [ChunkLayout(len(s.prompt), 0, t, i) for i, (s, t) in enumerate(zip(samples, tables))]
    for name, w in workers.items():
        run = layered.get(name)
        w.begin_step(layout if run is None else [run.chunk(i, i, 0, len(s.prompt), len(s.prompt))
                                                 for i, s in enumerate(samples)])
    ends = list(itertools.accumulate(len(s.prompt) for s in samples))
    logits, _ = forward([t for s in samples for t in s.prompt], [p for s in samples for p in range(len(s.prompt))],
                        [e - 1 for e in ends], prefill, [(i, 0, len(s.prompt), 0) for i, s in enumerate(samples)])
    first_tokens = logits.argmax(-1).tolist()
    answers = {}
    for name, worker in workers.items():
        outputs = [[t] for t in first_tokens]
        live = list(range(len(samples)))
        while True:
            done = [i for i in live if outputs[i][-1] in eos or len(outputs[i]) == samples[i].max_new_tokens]
            worker.free(done)
            live = [i for i in live if i not in done]
            if not live:
                break
            pos = [len(samples[i].prompt) + len(outputs[i]) - 1 for i in live]
            run = layered.get(name)
            worker.begin_step([ChunkLayout(1, p, tables[i], i) if run is None else run.chunk(i, i, p, 1, p + 1)
                               for i, p in zip(live, pos)])
            logits, _ = forward([outputs[i][-1] for i in live], pos, list(range(len(live))), worker.attend,
                                [(i, p, 1, 0) for i, p in zip(live, pos)])
            for i, t in zip(live, logits.argmax(-1).tolist()):
                outputs[i].append(t)
        answers[name] = [[t for t in out if t not in eos] for out in outputs]
    return answers


def evaluate_task(model, tok, task: str, context_tokens: list[int], num_samples: int, kv_formats: list[str], *,
                  haystack: list[str], oaken_cal=None, lsh=None, topk_frac: float | None = None, block_size: int = 16,
                  sparse_fraction: float = SPARSE_FRACTION, batch_samples: int = 4, seed: int = 0, progress: bool = True,
                  kv_policy=None) -> list[dict]:
    """Accuracy on `task` at each context length, for fp32 KV (the reference) and each variant of
    `evaluate` (formats, +magicpig, +topk, +layered with a layered `kv_policy`), on the same samples."""
    from tqdm import tqdm

    from evaluation.evaluate import sparse_part, variant_names
    from evaluation.layered import LAYERED_SUFFIX, LayeredRun, layered_names

    cfg = model.cfg
    names = ["fp32-exact"] + variant_names(kv_formats, lsh, topk_frac)
    layout = None
    if kv_policy is not None and kv_policy.is_layered:
        layout = kv_policy.layout(cfg.num_layers, cfg.max_position_embeddings)
        names += layered_names(kv_formats, lsh is not None, 0)
    rows = []
    bar = tqdm(total=num_samples * len(context_tokens), desc=task, unit="sample", disable=not progress)
    for ctx in context_tokens:
        samples = make_samples(task, tok, ctx, num_samples, haystack, seed)
        score = dict.fromkeys(names, 0.0)
        touched = dict.fromkeys(names, 0)
        eligible = dict.fromkeys(names, 0)
        for first in range(0, num_samples, batch_samples):
            batch = samples[first:first + batch_samples]
            blocks = sum(-(-(len(s.prompt) + s.max_new_tokens) // block_size) for s in batch)
            workers = {name: AttentionWorker(make_store("fp32" if name == "fp32-exact" else name.split("+")[0],
                                                        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size,
                                                        blocks, oaken_cal, sparse_fraction, len(batch)),
                                             cfg.head_dim, sparse_part(name, lsh, topk_frac, cfg))
                       for name in names if not name.endswith(LAYERED_SUFFIX)}
            most = max(-(-(len(s.prompt) + s.max_new_tokens) // block_size) for s in batch)
            layered = {name: LayeredRun(name.split("+")[0], cfg, layout, len(batch), most, block_size, oaken_cal,
                                        sparse_fraction, len(batch))
                       for name in names if name.endswith(LAYERED_SUFFIX)}
            workers.update((name, run.worker) for name, run in layered.items())
            for name, outs in generate(model, workers, batch, tok.eos_token_ids, layered).items():
                score[name] += sum(s.score(tok.decode(o)) for s, o in zip(batch, outs))
                if workers[name].sparse is not None:
                    t, e = workers[name].sparse.take_stats()
                    touched[name] += t
                    eligible[name] += e
            bar.update(len(batch))
        for name in names[1:]:
            is_layered = name.endswith(LAYERED_SUFFIX)
            row = {"task": task, "context_tokens": ctx, "kv_format": name.split("+")[0],
                   "attention": name.split("+")[1] if "+" in name and not is_layered else "exact",
                   "kv_policy": "layered" if is_layered else "full", "num_samples": num_samples,
                   "task_accuracy": score[name] / num_samples, "task_accuracy_ref": score["fp32-exact"] / num_samples}
            if eligible[name]:
                row["keys_touched_frac"] = touched[name] / eligible[name]
            if is_layered:
                row["kv_policy_settings"] = asdict(kv_policy)
            rows.append(row)
    bar.close()
    return rows


_WORDS = """apple river candle mountain pencil garden window silver thunder harbor lantern meadow
forest castle pepper marble violin rocket island desert anchor basket cotton dragon falcon ginger
helmet jacket kettle ladder magnet needle orange parrot quartz rabbit saddle tomato umbrella velvet
walnut yogurt zipper bridge cactus dolphin engine feather guitar hammer igloo jungle kitten lemon
mirror napkin oyster pillow quiver ribbon squirrel tunnel valley wagon barrel cherry copper blanket
button carpet circle cobalt cradle crayon dancer donkey fabric fossil goblet gravel hockey insect
jigsaw kayak lobster mitten muffin nectar outlet paddle pebble puzzle radish sandal scooter shovel
spider statue tablet teapot ticket turtle vessel violet wallet whistle wizard yellow zebra""".split()
