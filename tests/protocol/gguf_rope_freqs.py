"""Llama 3's rope scaling as llama.cpp's conversion stores it in a GGUF file: the rope_freqs tensor, one divisor
per rotary frequency (computed here from the config's rope parameters, as the conversion does)."""

import math

import numpy as np


def llama3_rope_freqs(rope: dict, theta: float, rotary_dim: int) -> np.ndarray:
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    divisors = []
    for i in range(0, rotary_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / rotary_dim)
        if wavelength < original / high:
            divisors.append(1.0)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)
