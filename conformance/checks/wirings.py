"""F8 block wirings on real layers: the backend's own Transformer encoder layer, Post-LN
(norm_first=False), Pre-LN (norm_first=True) and a two-layer Pre-LN stack with a final
LayerNorm, against the oracle's post_ln_block / pre_ln_block / pre_ln_stack given the
same weights and the attention and feed-forward sublayers they need (dropout 0), in
values and input gradients. Each check varies the activation, the number of heads and
eps, and asks once without and once with a gradient."""

from __future__ import annotations

from ..ops.blocks import encoder_layer_case
from . import check

#: (activation, heads, eps, with gradient): a forward-only relu case and a gelu one with
#: dL/dx, so a backend that ignores any of these parameters misses one of them.
_VARIANTS = (("relu", 4, 1e-5, False), ("gelu", 2, 1e-3, True))


def _cases(ctx, *, seed, norm_first, num_layers=1, final_norm=False):
    for activation, heads, eps, gradient in _VARIANTS:
        what = "output and dL/dx" if gradient else "output"
        with ctx.case(f"{activation}, {heads} heads, eps {eps:g}: {what}", op="encoder_layer"):
            ctx.require("encoder_layer", gradient=gradient)
            encoder_layer_case(ctx, seed=seed, norm_first=norm_first, activation=activation,
                               num_heads=heads, eps=eps, num_layers=num_layers,
                               final_norm=final_norm, gradient=gradient)


@check("F8.post_ln", title="norm_first=False is Post-LN: LN(x + sublayer(x)) twice, as "
       "post_ln_block wires it", ops=("encoder_layer",))
def post_ln(ctx):
    _cases(ctx, seed=ctx.seed + 800, norm_first=False)


@check("F8.pre_ln", title="norm_first=True is Pre-LN: x + sublayer(LN(x)) twice, as "
       "pre_ln_block wires it", ops=("encoder_layer",))
def pre_ln(ctx):
    _cases(ctx, seed=ctx.seed + 850, norm_first=True)


@check("F8.pre_ln_stack", title="Two Pre-LN layers and a final LayerNorm "
       "(TransformerEncoder(norm=LayerNorm)) as pre_ln_stack wires them", ops=("encoder_layer",))
def pre_ln_stack(ctx):
    _cases(ctx, seed=ctx.seed + 900, norm_first=True, num_layers=2, final_norm=True)
