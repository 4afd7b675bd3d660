"""The demo's two encoder-decoder models, their vocabulary, and greedy decoding (see :mod:`attnkit.tools.demo`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit.cache import CrossKVCache, KVCache
from attnkit.layers import AdditiveAttention, MultiHeadAttention

__all__ = ["BOS", "EOS", "LABELS", "PAD", "VOCAB", "AdditiveSeq2Seq", "Seq2Seq", "TransformerSeq2Seq", "greedy"]

# B batch, S source length (padded), T target length, E embedding size, h hidden size, d model size, H heads,
# V vocabulary size

PAD, BOS, EOS = 10, 11, 12  # tokens 0..9 are the digits themselves
LABELS = [str(digit) for digit in range(10)] + ["<pad>", "<bos>", "<eos>"]
VOCAB = len(LABELS)


class Seq2Seq(nn.Module):
    """What both models provide: ``encode`` the source once, ``decode`` a whole (teacher-forced) prefix."""

    cross_attention_name: str  # in named_modules(): the cross-attention layer whose weights the demo shows

    def encode(self, src: Tensor, lens: Tensor) -> Tensor:
        """Args: src ``(B, S)``, lens ``(B,)``. Returns the encoder outputs ``(B, S, features)``."""
        raise NotImplementedError

    def decode(self, memory: Tensor, lens: Tensor, tgt_in: Tensor) -> Tensor:
        """Args: memory ``(B, S, features)``, lens ``(B,)``, tgt_in ``(B, T)``. Returns logits ``(B, T, V)``."""
        raise NotImplementedError

    def forward(self, src: Tensor, lens: Tensor, tgt_in: Tensor) -> Tensor:
        """Args: src ``(B, S)``, lens ``(B,)``, tgt_in ``(B, T)``. Returns logits ``(B, T, V)``."""
        return self.decode(self.encode(src, lens), lens, tgt_in)


class AdditiveSeq2Seq(Seq2Seq):
    """Bidirectional GRU encoder; GRU decoder whose states query :class:`AdditiveAttention` (Luong's layout)."""

    cross_attention_name = "attention"

    def __init__(self, embed_size: int = 32, num_hiddens: int = 64) -> None:
        super().__init__()
        h = num_hiddens
        self.embedding = nn.Embedding(VOCAB, embed_size, padding_idx=PAD)
        self.encoder = nn.GRU(embed_size, h, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * h, h)
        self.decoder = nn.GRU(embed_size, h, batch_first=True)
        self.attention = AdditiveAttention(h, query_size=h, key_size=2 * h)
        self.output = nn.Linear(h + 2 * h, VOCAB)

    def encode(self, src: Tensor, lens: Tensor) -> Tensor:
        # Packed, so that the backward direction starts at the last digit, not in the padding: its states then
        # count positions from the end, which is what reversal needs.
        embedded = self.embedding(src)  # (B, S, E)
        packed = nn.utils.rnn.pack_padded_sequence(embedded, lens, batch_first=True, enforce_sorted=False)
        outputs, _ = self.encoder(packed)
        memory, _ = nn.utils.rnn.pad_packed_sequence(outputs, batch_first=True, total_length=src.shape[1])
        return memory  # (B, S, 2h): forward direction, then backward

    def decode(self, memory: Tensor, lens: Tensor, tgt_in: Tensor) -> Tensor:
        h = self.decoder.hidden_size
        batch = torch.arange(memory.shape[0])  # (B,)
        # the final state of each direction: the forward one at the last digit, the backward one at the first
        final = torch.cat([memory[batch, lens - 1, :h], memory[:, 0, h:]], dim=-1)  # (B, 2h)
        state = torch.tanh(self.bridge(final)).unsqueeze(0)  # (1, B, h)
        queries, _ = self.decoder(self.embedding(tgt_in), state)  # (B, T, h)
        context = self.attention(queries, memory, memory, lens)  # (B, T, 2h)
        return self.output(torch.cat([queries, context], dim=-1))  # (B, T, 3h) -> (B, T, V)


class TransformerSeq2Seq(Seq2Seq):
    """A pre-LayerNorm Transformer encoder-decoder with learned positions."""

    def __init__(
        self,
        *,
        max_positions: int,
        num_hiddens: int = 64,
        num_heads: int = 4,
        ffn_hiddens: int = 128,
        num_layers: int = 2,
    ) -> None:
        super().__init__()
        d = num_hiddens
        self.cross_attention_name = f"decoder.{num_layers - 1}.cross_attention"
        self.embedding = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.positions = nn.Embedding(max_positions, d)
        self.encoder = nn.ModuleList(_EncoderBlock(d, num_heads, ffn_hiddens) for _ in range(num_layers))
        self.decoder = nn.ModuleList(_DecoderBlock(d, num_heads, ffn_hiddens) for _ in range(num_layers))
        self.encoder_norm = nn.LayerNorm(d)
        self.decoder_norm = nn.LayerNorm(d)
        self.output = nn.Linear(d, VOCAB)

    def _embed(self, tokens: Tensor) -> Tensor:
        return self.embedding(tokens) + self.positions(torch.arange(tokens.shape[1]))  # (B, L) -> (B, L, d)

    def encode(self, src: Tensor, lens: Tensor) -> Tensor:
        x = self._embed(src)  # (B, S, d)
        for block in self.encoder:
            x = block(x, lens)
        return self.encoder_norm(x)  # (B, S, d)

    def decode(self, memory: Tensor, lens: Tensor, tgt_in: Tensor) -> Tensor:
        y = self._embed(tgt_in)  # (B, T, d)
        for block in self.decoder:
            y = block(y, memory, lens)
        return self.output(self.decoder_norm(y))  # (B, T, V)

    def generate(self, memory: Tensor, lens: Tensor, steps: int) -> Tensor:
        """Greedy decoding of ``steps`` tokens with key/value caches: each step projects and attends from its one
        new token only (the encoder's keys and values are projected once). Returns ``(B, steps)``."""
        caches = [(KVCache(), CrossKVCache()) for _ in self.decoder]
        token = torch.full((memory.shape[0], 1), BOS, device=memory.device)  # (B, 1)
        out = []
        for t in range(steps):
            y = self.embedding(token) + self.positions.weight[t]  # (B, 1, d)
            for block, block_caches in zip(self.decoder, caches, strict=True):
                y = block(y, memory, lens, block_caches)
            token = self.output(self.decoder_norm(y))[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            out.append(token)
        return torch.cat(out, dim=1)  # (B, steps)


class _EncoderBlock(nn.Module):
    """Pre-LayerNorm: ``x + self-attention(norm(x))`` over the digits, then ``x + ffn(norm(x))``."""

    def __init__(self, d: int, num_heads: int, ffn_hiddens: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d)
        self.attention = MultiHeadAttention(d, num_heads, query_size=d, key_size=d, value_size=d)
        self.ffn_norm = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, ffn_hiddens), nn.ReLU(), nn.Linear(ffn_hiddens, d))

    def forward(self, x: Tensor, lens: Tensor) -> Tensor:
        """Args: x ``(B, S, d)``, lens ``(B,)``. Returns ``(B, S, d)``."""
        h = self.attention_norm(x)
        x = x + self.attention(h, h, h, lens)
        return x + self.ffn(self.ffn_norm(x))


class _DecoderBlock(nn.Module):
    """Pre-LayerNorm: causal self-attention, cross-attention to the digits, feed-forward, each residual."""

    def __init__(self, d: int, num_heads: int, ffn_hiddens: int) -> None:
        super().__init__()
        self.self_attention_norm = nn.LayerNorm(d)
        self.self_attention = MultiHeadAttention(d, num_heads, query_size=d, key_size=d, value_size=d)
        self.cross_attention_norm = nn.LayerNorm(d)
        self.cross_attention = MultiHeadAttention(d, num_heads, query_size=d, key_size=d, value_size=d)
        self.ffn_norm = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, ffn_hiddens), nn.ReLU(), nn.Linear(ffn_hiddens, d))

    def forward(
        self, y: Tensor, memory: Tensor, lens: Tensor, caches: tuple[KVCache, CrossKVCache] | None = None
    ) -> Tensor:
        """Args: y ``(B, T, d)``, memory ``(B, S, d)``, lens ``(B,)`` source lengths; caches: the self- and
        cross-attention caches when decoding step by step (``y`` then holds the new positions only). Returns
        ``(B, T, d)``."""
        self_cache, cross_cache = caches if caches is not None else (None, None)
        h = self.self_attention_norm(y)
        y = y + self.self_attention(h, h, h, is_causal=True, cache=self_cache)
        y = y + self.cross_attention(self.cross_attention_norm(y), memory, memory, lens, cache=cross_cache)
        return y + self.ffn(self.ffn_norm(y))


# Evaluation -------------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy(model: Seq2Seq, src: Tensor, lens: Tensor, steps: int, *, cache: bool = True) -> Tensor:
    """Greedy decoding of ``steps`` tokens: with key/value caches when the model has them (the Transformer's
    ``generate``), else decoding the whole prefix again at each step. Returns ``(B, steps)``."""
    model.eval()
    memory = model.encode(src, lens)
    if cache and isinstance(model, TransformerSeq2Seq):
        return model.generate(memory, lens, steps)
    tokens = torch.full((src.shape[0], 1), BOS)  # (B, 1)
    for _ in range(steps):
        logits = model.decode(memory, lens, tokens)  # (B, t, V)
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)  # (B, t + 1)
    return tokens[:, 1:]  # (B, steps)
