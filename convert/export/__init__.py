"""Export layer: the functions' specs, the export modules that call a core, quantized weights in a graph, the
Hadamard rotation."""
