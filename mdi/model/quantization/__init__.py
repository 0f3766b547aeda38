"""Quantized weights and the kernels that multiply with them: the int8 / int4 formats and their
conversions (quant), the quantized matrix products and which a layer may try (qkernels), the
kernel each layer runs, chosen by measurement (kernel_choice, kernel_timing), and those
measurements remembered per machine (kernel_memory).
"""
