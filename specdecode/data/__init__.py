"""Prompt datasets of the three drafter domains (code, math, chat) and their held-out split."""
