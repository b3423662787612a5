"""The claims of the normalization document, by id, as the report cites them.

Paraphrased from shared/document/claims.md (the English list of the Chinese source
document); where the two differ the document wins, and so must this table."""

CLAIMS: dict[str, str] = {
    "F1": "BatchNorm (train): per channel, mean and biased variance over the batch axis "
          "(and every axis after the channel); y = gamma (x - mu) / sqrt(var + eps) + beta.",
    "F2": "LayerNorm: per sample over the trailing normalized_shape axes, "
          "y = gamma (x - mu) / sqrt(var + eps) + beta, var biased, eps inside the sqrt.",
    "F3": "RMSNorm: y = gamma x / sqrt(mean(x^2) + eps); no mean subtraction: the raw second "
          "moment, not the variance.",
    "F4": "BatchNorm running statistics: the forward uses v_b = sum (x-mu)^2 / m, the running "
          "variance is updated with the unbiased v_u = sum (x-mu)^2 / (m-1); "
          "run <- (1-a) run + a stat, a weighting the new batch.",
    "F5": "BatchNorm eval uses running_mean / running_var; with track_running_stats=False it "
          "uses the current batch's statistics.",
    "F6": "QK-norm: q_hat = RMSNorm(q), k_hat = RMSNorm(k) over head_dim, each with its own "
          "gain; s = q_hat . k_hat / sqrt(d_k).",
    "F7": "Soft-capping s -> c tanh(s / c) keeps scores inside (-c, c).",
    "F8": "Block wiring: Post-LN, Pre-LN with a final LN, and the Gemma-3 sandwich.",
    "F2/F3": "LayerNorm and RMSNorm (F2, F3) on inputs that break careless kernels.",
    "E1": "x = [1, 3]: LayerNorm [-1, 1]; RMSNorm [0.4472136, 1.3416408].",
    "E2": "x = [11, 13]: LayerNorm still [-1, 1]; RMSNorm [0.9135003, 1.0795912].",
    "E3": "BatchNorm1d(1, eps=0, momentum=1, affine=False) on [[1],[3]]: train [-1, 1], "
          "running_var 2, eval [-0.7071068, 0.7071068].",
    "E4": "One batch [0,2,10,12] against micro-batches [0,2], [10,12]: running statistics, "
          "outputs, loss and gradients differ.",
    "E5": "QK logits: scaling W_Q, W_K by 3 turns softmax [0.731, 0.269] into nearly one-hot.",
    "E6": "QK-norm removes that growth: RMSNorm([6, 3]) == RMSNorm([2, 1]).",
    "E7": "With gain 1 and eps = 0, |s| <= sqrt(d_k) (11.3137085 for d_k = 128); learned gains "
          "can raise the bound.",
    "E8": "RoPE is a rotation: the bound of E7 holds before or after RoPE.",
    "B1": "LayerNorm is invariant to adding a constant to a sample; RMSNorm is not.",
    "B2": "LayerNorm and RMSNorm are invariant to positive scaling when eps is ignored "
          "(eps breaks exact invariance and must be accounted for).",
    "B3": "BatchNorm on [1, C] in training raises; in eval it runs on running statistics; "
          "[1, C, L] with L > 1 trains.",
    "B4": "The same batch gives different outputs in train and eval mode.",
    "B5": "Running statistics update at every training-mode forward, not at optimizer.step().",
    "B6": "no_grad() turns off gradient recording but not BatchNorm's mode: in training mode "
          "it still updates running statistics.",
    "B7": "Gradient accumulation over micro-batches is not equivalent to one large batch with "
          "batch statistics.",
    "B8": "normalized_shape, not the layer's name, decides which axes are normalized.",
    "B9": "If the same input must give the same output in any batch, do not use batch "
          "statistics.",
    "DP1": "Beyond the document (B7/E4 at scale): local BatchNorm under data parallelism over "
           "R replicas is the oracle on each shard (outputs, dL/dx, gradients before and after "
           "the gradient all-reduce), and differs from the global batch.",
    "DP2": "Beyond the document: cross-replica (sync) BatchNorm is BatchNorm of the global "
           "batch: outputs, gradients, running mean and the unbiased running variance from the "
           "global count, for shards of any size; B3 applies to the global count.",
    "DP3": "Beyond the document: between data-parallel steps the running statistics follow "
           "the framework's declared buffer rule (each replica's own, or replica 0's "
           "broadcast at every forward as DistributedDataParallel does by default).",
    "protocol": "The backend protocol: outputs of the input's shape and dtype, inputs never "
                "modified, conventions as declared.",
}


def claim_text(claim_id: str) -> str:
    return CLAIMS.get(claim_id, "")
