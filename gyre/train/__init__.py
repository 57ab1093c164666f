"""gyre.train: a library a trainer rank calls: policy loss, trainer backends (Megatron-Core,
embedded torch), models, weight export. The processes that run it (a cell's trainer ranks, their
protocol, the cross-cell reduce groups) are the cell's and live in gyre.cell.

base           the Trainer interface every backend implements, shared helpers
backends       the table of backends by name (`train.backend`), make_trainer
trainer        EmbeddedTrainer: plain torch on the model of qwen2.py (any gyre.model family)
megatron_*     the Megatron-Core backend: model (weight layouts, tree core attention), trainer,
               CPU layer
tree_attention attention whose work follows the tree (block-sparse on CPU, FlexAttention on CUDA)
loss           policy loss against recorded behaviour log-probs, off-policy corrections
step_stats     micro-batch statistics merged into a step's (torch-free: the head merges them)
offload        host stash of accelerator storage for role switches
export         atomic directories, transformers-layout weights (engines load them from disk)
dist           torch.distributed inside a cell (the world its ranks form)
cli            `gyre train`: offline steps from HDF5 shards
toy            small random models built in code (tests, benchmarks)

The MicroBatch contract (gyre.batch) and advantage estimators (gyre.advantage) sit below both
gyre.traj and gyre.train.
"""
