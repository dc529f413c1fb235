"""C++ code generation for .proto files with Debian's protoc and grpc_cpp_plugin."""

def grpc_cc_library(name, proto, deps = [], **kwargs):
    """A cc_library of the messages and gRPC stubs generated from one .proto file.

    Args:
      name: the cc_library.
      proto: the .proto file in this package, e.g. "tpud.proto".
      deps: extra deps of the library.
      **kwargs: passed to cc_library (visibility, ...).
    """
    base = proto[:-len(".proto")]
    outs = [base + ext for ext in [".pb.h", ".pb.cc", ".grpc.pb.h", ".grpc.pb.cc"]]
    native.genrule(
        name = name + "_gen",
        srcs = [proto],
        outs = outs,
        cmd = "protoc -I. --cpp_out=$(GENDIR) --grpc_out=$(GENDIR) " +
              "--plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin) $(location %s)" % proto,
    )
    native.cc_library(
        name = name,
        srcs = [base + ".pb.cc", base + ".grpc.pb.cc"],
        hdrs = [base + ".pb.h", base + ".grpc.pb.h"],
        copts = ["-Wno-unused-parameter"],
        deps = ["@grpc"] + deps,
        **kwargs
    )
