#!/bin/sh
echo "coverage is not supported in this offline build of tpud" >&2
exit 1
