"""sptool: self-play RL with verifiable rewards as small, composable JSONL stages."""

__version__ = "0.1.0"
