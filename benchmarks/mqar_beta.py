"""Probe: does the write strength β hold the delta-rule mixers back on MQAR at tiny width?

Trains one 2-layer model (letter L, D or G) on MQAR for a few hundred steps and prints loss and
query accuracy every 100 steps, with β as the layer computes it (``learned``: sigmoid(b_proj x),
which starts at 0.5), fixed at 1 (``one``), or learned from a +3 offset (``offset3``: starts at
0.95). Results are recorded in the issue notes; this is a diagnostic, not part of the suite.

    OMP_NUM_THREADS=1 python benchmarks/mqar_beta.py D --beta offset3 --width 64 --pairs 8 --lr 1e-2
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from gdn.data import mqar_batch
from gdn.models import GDNForCausalLM, param_groups
from gdn.train.mqar import MQARConfig, accuracy, model_config


def patch_beta(mode: str) -> None:
    """Make the (Gated) DeltaNet layers compute β as ``mode`` says (``learned`` leaves them alone)."""
    if mode == "learned":
        return
    import gdn.layers.deltanet as dn
    import gdn.layers.gated_deltanet as gdl

    def beta_of(layer, x):
        if mode == "one":
            return torch.ones(x.shape[0], x.shape[1], layer.num_v_heads, dtype=torch.float32, device=x.device)
        return torch.sigmoid(layer.b_proj(x).float() + 3.0)

    def dn_mix(self, q, k, v, x, mask, initial_state, output_final_state, cu_seqlens):
        from gdn import ops
        from gdn.layers._recurrent import l2_normalise

        return ops.delta_rule(l2_normalise(q), l2_normalise(k), v, beta_of(self, x), initial_state=initial_state,
                              output_final_state=output_final_state, cu_seqlens=cu_seqlens)

    def gdn_mix(self, q, k, v, x, mask, initial_state, output_final_state, cu_seqlens):
        from gdn import ops
        from gdn.layers._recurrent import l2_normalise, scalar_decay

        g = scalar_decay(self.a_proj(x), self.A_log, self.dt_bias)
        return ops.gated_delta_rule(l2_normalise(q), l2_normalise(k), v, g, beta_of(self, x),
                                    initial_state=initial_state, output_final_state=output_final_state,
                                    cu_seqlens=cu_seqlens)

    dn.DeltaNet._mix = dn_mix
    gdl.GatedDeltaNet._mix = gdn_mix


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("letter", choices=list("LMDGA"), help="mixer letter")
    p.add_argument("--beta", choices=["learned", "one", "offset3"], default="learned", help="how β is formed")
    p.add_argument("--width", type=int, default=64, help="model width")
    p.add_argument("--pairs", type=int, default=8, help="key-value pairs")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    p.add_argument("--seq-len", type=int, default=64, help="sequence length")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    p.add_argument("--steps", type=int, default=400, help="training steps of 64 sequences")
    a = p.parse_args()
    torch.set_num_threads(1)
    patch_beta(a.beta)
    cfg = MQARConfig(seq_len=a.seq_len, vocab_size=a.vocab, widths=[a.width], num_pairs=[a.pairs], num_heads=2)
    x, y = mqar_batch(20000, a.seq_len, a.pairs, a.vocab, seed=1)
    xt, yt = mqar_batch(256, a.seq_len, a.pairs, a.vocab, seed=2)
    torch.manual_seed(0)
    m = GDNForCausalLM(model_config(a.letter, a.width, cfg))
    opt = torch.optim.AdamW(param_groups(m, 0.1), lr=a.lr, betas=(0.9, 0.98))
    t0 = time.time()
    for s in range(a.steps):
        idx = torch.randint(0, 20000, (64,))
        logits = m(input_ids=x[idx], use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, a.vocab), y[idx].reshape(-1), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if (s + 1) % 100 == 0:
            print(f"{a.letter} beta={a.beta} step {s + 1}: loss {loss.item():.3f}, "
                  f"accuracy {accuracy(m, xt, yt):.3f} ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
