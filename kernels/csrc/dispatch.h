// Register tiles sized at compile time, picked at run time by the rows or columns left.
#pragma once

#include <type_traits>
#include <utility>

namespace vlmserve {

// f(std::integral_constant<int, n>{}) for n in [1, Max]; larger n give Max.
template <int Max, typename F>
inline void with_constant(int n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_constant<Max - 1>(n, std::forward<F>(f));
  }
  f(std::integral_constant<int, Max>{});
}

}  // namespace vlmserve
