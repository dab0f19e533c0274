// refitctl: see client/refitctl.h (and `refitctl --help`).
#include <iostream>

#include "client/refitctl.h"

int main(int argc, char** argv) {
  return refit::client::RunRefitctl(argc, argv, std::cout, std::cerr);
}
