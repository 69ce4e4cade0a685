"""Llama 3's rope scaling from a GGUF file, where llama.cpp keeps it only as the rope_freqs tensor.

rope_freqs holds one divisor per rotary frequency: 1 for short wavelengths, the scaling factor for long ones,
1 / ((1 - s) / factor + s) on the ramp between, where s = (L / wavelength - low) / (high - low) with L the original
context and low / high the frequency factors. s is linear in 1 / wavelength, and L, low and high are fixed by the
tensor only up to a common scale; L is taken as the one that makes low 1 (as every Llama 3 release has it). The
parameters are refused unless they give back every stored divisor.
"""

import math

_EDGE = 1e-6  # a divisor within this of 1 or of the factor is off the ramp
_MATCH = 1e-4  # relative: the divisors are stored as float32


def rope_freqs_divisors(reader) -> list[float] | None:
    """The rope_freqs tensor's values, or None when the file has none."""
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    import gguf

    return [float(x) for x in gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1)]


def llama3_scaling(divisors: list[float], theta: float, rotary_dim: int) -> dict | None:
    """The llama3 rope_scaling dict that gives these divisors (None when none divides); ValueError otherwise."""
    factor = max(divisors)
    if factor <= 1 + _EDGE:
        return None
    wavelengths = [2 * math.pi * theta ** (2 * i / rotary_dim) for i in range(len(divisors))]
    kept = [(1 / d - 1 / factor) / (1 - 1 / factor) for d in divisors]  # 1: not divided, 0: by the factor
    ramp = [(1 / w, k) for w, k in zip(wavelengths, kept, strict=True) if _EDGE < k < 1 - _EDGE]
    if len(ramp) < 2:
        raise ValueError(f"rope_freqs.weight: {len(ramp)} frequencies between the kept and the scaled ones, too "
                         "few to tell Llama 3's rope scaling from")
    slope, intercept = _line(ramp)  # kept = slope / wavelength + intercept on the ramp
    if slope <= 0 or intercept >= 0:
        raise ValueError("rope_freqs.weight does not follow Llama 3's rope scaling")
    original = round(-slope / intercept)
    low = -intercept * original / slope
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": low + original / slope, "original_max_position_embeddings": original}
    if any(abs(llama3_divisor(w, scaling) - d) > _MATCH * d for w, d in zip(wavelengths, divisors, strict=True)):
        raise ValueError("rope_freqs.weight does not follow Llama 3's rope scaling")
    return scaling


def llama3_divisor(wavelength: float, scaling: dict) -> float:
    """What Llama 3's scaling divides the frequency of this wavelength by."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    if wavelength < original / high:
        return 1.0
    if wavelength > original / low:
        return factor
    smooth = (original / wavelength - low) / (high - low)
    return 1 / ((1 - smooth) / factor + smooth)


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope and intercept of y over x."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return slope, my - slope * mx
