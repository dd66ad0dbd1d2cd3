"""train-eagle's parts (the job itself: offline/train_eagle.py): its options, text, features, the head
and its training."""
