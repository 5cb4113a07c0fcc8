"""SFT, rejection-sampling fine-tuning and DPO.

The baselines a GRPO result is judged against, trained by the same machinery as `rlvr train`
(run.py: run directory, checkpoints with exact resume, metrics, alerts, report, evaluation
before and after) and the same stage-4 pieces (logprobs.LogProbs with the fast path,
update.optimizer_step, optim.build_optimizer); only the loss and the data differ.

    data.py      demonstrations and preference pairs: from a dataset, a built-in task, or the
                 model's own verified samples; tokenised into update Batches, optionally packed
    losses.py    pure functions: the SFT token loss, DPO / IPO / hinge over sequence log-probs
    trainer.py   one optimizer step of SFT or DPO, with run.py's trainer interface
    api.py       TRL's SFTConfig / SFTTrainer / DPOConfig / DPOTrainer
"""
