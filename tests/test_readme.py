"""The README's quick tour, run as written: its python block over a corpus built here, with a tiny
real varlen model as ``model`` (the one name the block leaves to the reader)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tests.helpers import read_built, readme_python_block, write_jsonl

VOCAB = 257  # the bytes tokenizer: 256 byte ids + EOS


class TinyVarlenLM(torch.nn.Module):
    """One attention layer over flat THD batches, the call signature the quick tour uses."""

    def __init__(self, dim: int = 32, heads: int = 2, max_positions: int = 8192) -> None:
        super().__init__()
        self.heads = heads
        self.tok = torch.nn.Embedding(VOCAB, dim)
        self.pos = torch.nn.Embedding(max_positions, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.head = torch.nn.Linear(dim, VOCAB)
        self.calls: list[tuple[torch.Tensor, ...]] = []

    def forward(self, input_ids, position_ids, cu_seqlens, max_seqlen):
        import h5corpus

        x = self.tok(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, -1).unbind(1)
        a = h5corpus.causal_attention(q, k, v, cu_seqlens, max_seqlen)
        logits = self.head(x + a.reshape(x.shape))
        self.calls.append((input_ids, position_ids, cu_seqlens.clone(), logits.detach()))
        return logits


def test_readme_quick_tour_runs(tmp_path, stdlib_corpus_texts, monkeypatch):
    """Every batch of the epoch reaches the model (its inputs = every next-token pair's input of the
    stored documents, read from the shard files with h5py), each segment of the first batch gets the
    logits of the model run on that segment alone (no attention across documents), and the loss is
    the plain mean cross-entropy of the last batch."""
    import h5corpus

    monkeypatch.chdir(tmp_path)
    texts = sorted(stdlib_corpus_texts, key=len)[:70]  # about 3 of the README's batches: many short documents
    write_jsonl(tmp_path / "docs.jsonl", texts)
    h5corpus.build_corpus(h5corpus.BuildConfig(sources=["docs.jsonl"], tokenizer="bytes", workers=1))
    stored = read_built(tmp_path / "manifests" / "shards.json")["train"]
    want_pairs = sum(len(tokens) - 1 for _, tokens, _ in stored)
    assert want_pairs > 2 * 4096 * 35, "the corpus must fill more than two of the README's batches"

    model = TinyVarlenLM()
    env = {"model": model}
    with torch.no_grad():
        exec(compile(readme_python_block("Quick tour"), "README.md", "exec"), env)
        calls, model.calls = model.calls, []
        assert len(calls) >= 3
        input_ids, position_ids, cu, logits = calls[0]
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone = model(input_ids[s:e], position_ids[s:e], torch.tensor([0, e - s], dtype=torch.int32), e - s)
            torch.testing.assert_close(alone, logits[s:e], rtol=1e-4, atol=1e-5)

    inputs = torch.cat([c[0] for c in calls]).numpy()
    want_inputs = np.concatenate([tokens[:-1] for _, tokens, _ in stored])
    assert len(inputs) == want_pairs
    np.testing.assert_array_equal(np.bincount(inputs, minlength=VOCAB), np.bincount(want_inputs, minlength=VOCAB))

    last, logits = env["b"], calls[-1][3]
    real = last.targets != -100
    assert int(real.sum()) == len(calls[-1][0])
    want_loss = F.cross_entropy(logits[real], last.targets[real])
    assert abs(env["loss"].item() - want_loss.item()) < 1e-5
    assert env["checkpoint"]["loader"], "the checkpoint holds the loader's state"
