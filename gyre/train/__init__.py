"""gyre.train: policy loss, trainer backends (Megatron-Core, embedded torch), weight export and push.

base           the Trainer interface every backend implements, shared helpers
backends       the table of backends by name (`train.backend`), make_trainer
trainer        EmbeddedTrainer: plain torch on the transformers model
megatron_*     the Megatron-Core backend: model (Qwen2 clone + weight layouts, tree core
               attention), trainer, CPU layer
tree_attention attention whose work follows the tree (block-sparse on CPU, FlexAttention on CUDA)
loss           policy loss against recorded behaviour log-probs
offload        host stash of accelerator storage for role switches
export         atomic directories, transformers-layout weights; weights_push: engine endpoints

The MicroBatch contract (gyre.batch) and advantage estimators (gyre.advantage) sit below both
gyre.traj and gyre.train.
"""
