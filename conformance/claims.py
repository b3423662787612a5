"""The claims normspec verifies, by id: the normalization document's formulas (F1-F8),
worked examples (E1-E8) and behaviours (B1-B9), in normspec's own words, plus the
protocol's promises. The report cites `claim_text`; `normspec claims` prints the claim ->
checks table and writes docs/claims.md (see `markdown`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    id: str
    title: str
    says: str
    formula: str = ""
    example: str = ""


_CLAIMS = (
    Claim("F1", "BatchNorm in training",
          "Per channel, the mean and the biased variance are taken over the batch axis and "
          "every axis after the channel; the input is centred, divided by the standard "
          "deviation with eps inside the root, then scaled and shifted.",
          "mu_c = mean(x[:, c, ...]); var_c = mean((x[:, c, ...] - mu_c)^2)\n"
          "y = gamma_c (x - mu_c) / sqrt(var_c + eps) + beta_c"),
    Claim("F2", "LayerNorm",
          "Per sample, over the trailing normalized_shape axes (one or more): the same "
          "centring and scaling as F1, biased variance, eps inside the root.",
          "y = gamma (x - mean(x)) / sqrt(var(x) + eps) + beta"),
    Claim("F3", "RMSNorm",
          "Divides by the root of the raw second moment over the trailing axes; nothing is "
          "subtracted, so it is not LayerNorm with the mean assumed zero.",
          "y = gamma x / sqrt(mean(x^2) + eps)"),
    Claim("F4", "BatchNorm running statistics",
          "The forward normalizes with the biased variance of the m values per channel, but "
          "the running variance is updated with the unbiased one; momentum a weights the "
          "new batch, for the mean and the variance alike (momentum None: a cumulative "
          "average).",
          "v_b = sum (x - mu)^2 / m; v_u = sum (x - mu)^2 / (m - 1)\n"
          "running <- (1 - a) running + a statistic"),
    Claim("F5", "BatchNorm in eval",
          "Eval mode normalizes with the running statistics; a layer that keeps none "
          "(track_running_stats=False) uses the batch's own statistics in eval too.",
          "y = gamma (x - running_mean) / sqrt(running_var + eps) + beta"),
    Claim("F6", "QK-norm",
          "Queries and keys are RMS-normalized per head over head_dim, each with its own "
          "gain, before the scaled dot product.",
          "s = RMSNorm_q(q) . RMSNorm_k(k) * scale, scale = 1 / sqrt(d_k) by default"),
    Claim("F7", "Soft-capping",
          "Scores pass through c tanh(s / c), which keeps them strictly inside (-c, c).",
          "s -> c tanh(s / c)"),
    Claim("F8", "Block wirings",
          "Post-LN normalizes after the residual sum; Pre-LN normalizes the branch input and "
          "needs a final norm after the last block; the sandwich wiring normalizes the "
          "branch before and its output after, keeping the residual path untouched. "
          "Inference engines fuse Pre-LN's residual add with the norm that follows it and "
          "return both the new residual and the normalized sum, under one of two "
          "arithmetic contracts that a backend declares: the norm of the sum rounded to the "
          "activation dtype (the eager composition) or of the unrounded float32 sum "
          "(vLLM's native IR); they differ in float16 and bfloat16.",
          "post: x = LN(x + F(x)); pre: x = x + F(LN(x)), final LN; "
          "sandwich: x = x + Norm_post(F(Norm_pre(x))); "
          "fused: r' = round(x + r), y = Norm(r') or Norm(x + r)"),
    Claim("F2/F3", "LayerNorm and RMSNorm on hard inputs",
          "F2 and F3 hold on inputs that break careless kernels: rows around +-1000 in "
          "float16, a large mean with a tiny spread, constant rows, non-contiguous memory, "
          "NaN and inf, subnormals, row counts past launch thresholds, hidden sizes that "
          "are not powers of two, ranks 2 to 4, strided and sliced views."),
    Claim("F1/F5", "BatchNorm on hard shapes and layouts",
          "F1, F4 and F5 hold for BatchNorm on row counts past launch thresholds and on "
          "strided, sliced, transposed and channels-last inputs."),
    Claim("E1", "x = [1, 3]", "LayerNorm and RMSNorm of one small row, eps = 0.",
          example="LayerNorm -> [-1, 1]; RMSNorm -> [1, 3] / sqrt(5) = [0.4472136, 1.3416408]"),
    Claim("E2", "x = [11, 13]", "E1 shifted by 10: LayerNorm ignores the shift, RMSNorm "
          "does not.",
          example="LayerNorm -> [-1, 1]; RMSNorm -> [11, 13] / sqrt(145) = "
                  "[0.9135003, 1.0795912]"),
    Claim("E3", "Train, then eval, on [[1], [3]]",
          "BatchNorm1d(1, eps=0, momentum=1, affine=False): the same batch gives different "
          "outputs in train and eval because the running variance is the unbiased one.",
          example="train [-1, 1]; running_var 2; eval [-0.7071068, 0.7071068]"),
    Claim("E4", "One batch against two micro-batches",
          "[0, 2, 10, 12] in one forward against [0, 2] then [10, 12], from running mean 0, "
          "running variance 1, momentum 0.1.",
          example="one batch: running_mean 0.6, running_var 4.3666667, outputs "
                  "[-1.1766968, -0.7844645, 0.7844645, 1.1766968]; micro-batches: "
                  "running_mean 0.1 then 1.19, running_var 1.1 then 1.19, outputs [-1, 1] "
                  "twice"),
    Claim("E5", "Logit growth without QK-norm",
          "Scaling W_Q and W_K by 3 multiplies the logits by 9.",
          example="q = [2, 1], keys [1, 0], [0, 1]: softmax [0.7310586, 0.2689414]; all x3: "
                  "[0.99987661, 0.00012339]"),
    Claim("E6", "QK-norm removes the growth",
          "The RMS norm of a scaled vector is the same vector's, so the scores no longer "
          "change.",
          example="RMSNorm([6, 3]) = RMSNorm([2, 1]) = [1.2649111, 0.6324555]"),
    Claim("E7", "The QK-norm bound",
          "With unit gains and eps = 0, |q_hat| = |k_hat| = sqrt(d_k), so |s| <= sqrt(d_k) "
          "with the usual 1/sqrt(d_k) scale; learned gains move the bound.",
          example="d_k = 128: |s| <= 11.3137085"),
    Claim("E8", "RoPE keeps the bound", "A rotation preserves length, so E7's bound holds "
          "with RoPE applied before or after the norm."),
    Claim("B1", "Shift", "Adding a constant to every feature of a sample leaves LayerNorm "
          "unchanged and changes RMSNorm."),
    Claim("B2", "Scale", "Multiplying a sample by a > 0 leaves LayerNorm and RMSNorm "
          "unchanged up to eps, exactly when eps is rescaled to eps / a^2 (a < 0 flips "
          "the sign)."),
    Claim("B3", "A batch of one", "BatchNorm refuses [1, C] in training (one value per "
          "channel), runs it in eval on the running statistics, and trains on [1, C, L] "
          "with L > 1."),
    Claim("B4", "Train and eval differ", "The same batch gives different outputs in train "
          "and eval mode (E3)."),
    Claim("B5", "Updates at every forward", "Running statistics change at every "
          "training-mode forward, not at the optimizer's step."),
    Claim("B6", "No-grad is not eval", "Turning off gradient recording does not switch "
          "BatchNorm to eval: in training mode it still updates its statistics."),
    Claim("B7", "Accumulation is not a big batch", "Gradient accumulation over "
          "micro-batches differs from one large batch when BatchNorm uses batch statistics "
          "(E4)."),
    Claim("B8", "normalized_shape decides", "Which axes are normalized follows "
          "normalized_shape, not the layer's name."),
    Claim("B9", "Batch invariance", "If a sample's output must not depend on what else is "
          "in its batch, batch statistics are out: LayerNorm, RMSNorm, QK-norm and eval "
          "BatchNorm give a sample the same output in any batch; training BatchNorm does "
          "not."),
    Claim("DP1", "Local BatchNorm under data parallelism",
          "Beyond the document (B7/E4 at scale): each of R replicas normalizes its own shard, "
          "so local BatchNorm is the oracle on each shard (outputs, dL/dx, gradients before "
          "and after the gradient all-reduce), and differs from the global batch.",
          example="E4 over 2 replicas, [0, 2] and [10, 12]: outputs [-1, 1] on each, running "
                  "means 0.1 and 1.1 (the global batch gives 0.6)"),
    Claim("DP2", "Cross-replica (sync) BatchNorm",
          "Beyond the document: statistics reduced over the global batch with a collective "
          "make sync BatchNorm the oracle on the concatenated shards: outputs, gradients, "
          "running mean and the unbiased running variance from the global count, for shards "
          "of any size; B3 applies to the global count."),
    Claim("DP3", "Buffers between data-parallel steps",
          "Beyond the document: the running statistics follow the framework's declared rule "
          "(each replica keeps its own, or replica 0's are broadcast at every forward, as "
          "DistributedDataParallel does by default)."),
    Claim("protocol", "The backend protocol", "Outputs have the input's shape and dtype, "
          "inputs are never modified, and the conventions a backend declares are what it "
          "does."),
)

CLAIMS: dict[str, Claim] = {c.id: c for c in _CLAIMS}


def claim_text(claim_id: str) -> str:
    c = CLAIMS.get(claim_id)
    return f"{c.title}: {c.says}" if c else ""


def markdown(checks, records: list[dict] | None = None, source: str = "") -> str:
    """docs/claims.md: every claim with its formula and example, the checks that verify
    it and, from a results document's records, what each backend did."""
    by_claim = {claim: [c for c in checks if c.verifies(claim)] for claim in CLAIMS}
    lines = ["# The claims normspec verifies", "",
             "Generated by `normspec claims --markdown"
             + (f" --results {source}`" if source else "`") + "; do not edit by hand.", ""]
    for claim in CLAIMS.values():
        lines += [f"## {claim.id}: {claim.title}", "", claim.says, ""]
        if claim.formula:
            lines += ["```", claim.formula, "```", ""]
        if claim.example:
            lines += [f"Worked example: {claim.example}.", ""]
        mine = by_claim.get(claim.id, [])
        if mine:
            lines += ["| check | ops | what it verifies |", "| --- | --- | --- |"]
            lines += [f"| `{c.id}` | {', '.join(c.ops) or 'every op'} | {c.title} |" for c in mine]
        else:
            lines += ["No check verifies it on a backend yet."]
        lines.append("")
        if records is not None:
            lines += _outcomes(claim.id, records, {claim.id: {c.id for c in mine}})
    return "\n".join(lines).rstrip() + "\n"


def _outcomes(claim_id: str, records: list[dict], also: dict[str, set]) -> list[str]:
    mine = [r for r in records if r["claim"] == claim_id or claim_id in r["claim"].split("/")
            or r["check"] in also.get(claim_id, ())]
    if not mine:
        return []
    counts: dict[str, dict[str, int]] = {}
    for r in mine:
        counts.setdefault(r["backend"], {}).setdefault(r["status"], 0)
        counts[r["backend"]][r["status"]] += 1
    lines = ["| backend | outcome |", "| --- | --- |"]
    for backend, c in counts.items():
        lines.append(f"| {backend} | " + ", ".join(f"{n} {s}" for s, n in sorted(c.items())) + " |")
    return lines + [""]
