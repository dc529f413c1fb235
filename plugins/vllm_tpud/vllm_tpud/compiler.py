"""vLLM's compiler interface for tpu: each piece of the model step between
attention calls becomes tpud programs.

With compilation on, vLLM traces the model once with Dynamo and splits the
graph at its attention ops (which read the step's metadata, so they stay
eager). vLLM hands every piece to `TpudCompiler.compile`; a piece runs as
torch_tpu's captured graph: the first call with a given input signature
(shapes, strides, host values such as the token count) records its ops
into one tpud program, and later calls with that signature run the program
with one record. The number of tokens in a step changes from step to step,
so a piece keeps up to MAX_SIGNATURES programs; a signature past them runs
op by op.
"""
from vllm.compilation.compiler_interface import CompilerInterface

MAX_SIGNATURES = 128


class TpudCompiler(CompilerInterface):
    name = "tpu"

    def compile(self, graph, example_inputs, compiler_config, compile_range, key=None):
        from torch_tpu import _compile

        piece = _compile._CompiledGraph(graph, "vllm piece", max_captures=MAX_SIGNATURES)
        output = next(n for n in graph.graph.nodes if n.op == "output")
        as_tuple = isinstance(output.args[0], (tuple, list))

        def run(*args):
            out = piece(list(args))
            return tuple(out) if as_tuple else out[0]

        run.piece = piece
        return run, None
