"""Repository rules that bring Debian's system libraries into the build.

Nothing is downloaded: headers are found in the system include path and link
flags come from pkg-config, so the same WORKSPACE works on Debian 12 and 13.
"""

def _pkg_config(ctx, args):
    res = ctx.execute(["pkg-config"] + args)
    if res.return_code != 0:
        fail("pkg-config %s failed: %s\nRun tools/setup.sh to install the system packages." %
             (" ".join(args), res.stderr))
    return res.stdout.strip()

def _split_flags(s):
    return [f for f in s.split(" ") if f]

def _dedupe_keep_last(flags):
    # Keep the last occurrence of each -l so static link order stays valid
    # while the list does not grow to hundreds of repeats.
    seen = {}
    out = []
    for f in reversed(flags):
        if f.startswith("-l") and f in seen:
            continue
        seen[f] = True
        out.append(f)
    return list(reversed(out))

def _pkg_config_repository_impl(ctx):
    libs = _dedupe_keep_last(_split_flags(_pkg_config(ctx, ["--libs"] + ctx.attr.modules)))
    cflags = _split_flags(_pkg_config(ctx, ["--cflags"] + ctx.attr.modules))
    copts = [f for f in cflags if not f.startswith("-I")]
    ctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % ctx.name)
    ctx.file("BUILD.bazel", """# Generated from pkg-config modules: {modules}
cc_library(
    name = "{name}",
    copts = {copts},
    linkopts = {libs},
    visibility = ["//visibility:public"],
)
""".format(name = ctx.name, modules = ", ".join(ctx.attr.modules), copts = repr(copts), libs = repr(libs)))

pkg_config_repository = repository_rule(
    implementation = _pkg_config_repository_impl,
    attrs = {"modules": attr.string_list(mandatory = True)},
    local = True,
)

def _catch2_repository_impl(ctx):
    # Debian 12 ships Catch2 2.x (single header); Debian 13 ships 3.x (split
    # headers plus a static main library).
    v3 = ctx.path("/usr/include/catch2/catch_all.hpp").exists
    v2 = ctx.path("/usr/include/catch2/catch.hpp").exists
    if not v3 and not v2:
        fail("Catch2 not found in /usr/include/catch2; run tools/setup.sh")
    ctx.file("WORKSPACE", "workspace(name = \"catch2\")\n")
    ctx.file("catch.h", """#pragma once
// Uniform Catch2 include for 2.x and 3.x.
#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#define TPUD_CATCH2_V3 1
#else
#include <catch2/catch.hpp>
#endif
""")
    if v3:
        libs = _split_flags(_pkg_config(ctx, ["--libs", "catch2-with-main"]))
        ctx.file("BUILD.bazel", """
cc_library(
    name = "catch2",
    hdrs = ["catch.h"],
    include_prefix = "catch2_compat",
    linkopts = {libs},
    visibility = ["//visibility:public"],
)
alias(name = "catch2_main", actual = ":catch2", visibility = ["//visibility:public"])
""".format(libs = repr(libs)))
    else:
        ctx.file("main.cc", "#define CATCH_CONFIG_MAIN\n#include <catch2/catch.hpp>\n")
        ctx.file("BUILD.bazel", """
cc_library(
    name = "catch2",
    hdrs = ["catch.h"],
    include_prefix = "catch2_compat",
    visibility = ["//visibility:public"],
)
cc_library(
    name = "catch2_main",
    srcs = ["main.cc"],
    deps = [":catch2"],
    visibility = ["//visibility:public"],
)
""")

catch2_repository = repository_rule(
    implementation = _catch2_repository_impl,
    local = True,
)
