"""The learnable suite (task folders) and its scoring; see README.md."""
