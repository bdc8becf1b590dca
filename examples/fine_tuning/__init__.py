"""DP fine-tuning of a small pretrained language model on Shakespeare's tragedies (``run.sh`` runs it all):
``corpus`` splits the plays, ``pretrain`` builds the public model and the private text, ``compare`` trains and
scores every variant. See docs/fine-tuning.md."""
