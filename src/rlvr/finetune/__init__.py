"""SFT, rejection-sampling fine-tuning and DPO.

The baselines a GRPO result is judged against, trained by the same machinery as `rlvr train`
(run.py and loop.py: run directory, checkpoints with exact resume, metrics, alerts, report,
evaluation before and after; trainer.RunCore: the parts every method checkpoints) and the same stage-4 pieces (logprobs.LogProbs with the fast path,
update.optimizer_step, optim.build_optimizer); only the loss and the data differ.

    data.py      demonstrations and preference pairs: from a dataset, a built-in task, or the
                 model's own verified samples; tokenised into update Batches, optionally packed
    losses.py    pure functions: the SFT token loss, DPO / IPO / hinge over sequence log-probs
    trainer.py   the step of SFT / RFT (FinetuneTrainer) and of DPO (PreferenceTrainer) on the parts
                 every method shares (trainer.RunCore)

TRL's SFTConfig / SFTTrainer / DPOConfig / DPOTrainer are in api/ with GRPO's; what differs
between the methods is in methods.py.
"""
