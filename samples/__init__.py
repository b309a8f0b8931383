"""Sample pictures, a sample video and the shipped model's answers about them
(answers.json); installed as vlmserve.samples so `vlmserve ui` offers them as examples."""
