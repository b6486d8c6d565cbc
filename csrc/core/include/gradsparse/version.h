// The core's version, for C++ programs that build against the installed headers: the same as
// the CMake package's (find_package(gradsparse 0.1)), pyproject.toml's and gradsparse.__version__
// (tests/python/test_install.py holds them equal). Until 1.0 a minor version may change the API.
#pragma once

#define GRADSPARSE_VERSION_MAJOR 0
#define GRADSPARSE_VERSION_MINOR 1
#define GRADSPARSE_VERSION_PATCH 0
#define GRADSPARSE_VERSION_STRING "0.1.0"
// One number to compare in #if: major * 10000 + minor * 100 + patch.
#define GRADSPARSE_VERSION \
  (GRADSPARSE_VERSION_MAJOR * 10000 + GRADSPARSE_VERSION_MINOR * 100 + GRADSPARSE_VERSION_PATCH)
