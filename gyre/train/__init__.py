"""gyre.train: policy loss, trainer backends (Megatron-Core, embedded torch), weight export and push.

batch          the MicroBatch contract with materialization (gyre.traj)
loss           policy loss against recorded behaviour log-probs; advantage: group estimators
trainer        the Trainer interface, EmbeddedTrainer, make_trainer
megatron_*     the Megatron-Core backend: model (Qwen2 clone + weight layouts), trainer, CPU layer
offload        host stash of accelerator storage for role switches
export         atomic directories, transformers-layout weights; weights_push: engine endpoints
"""
