// Small, portable integer mixing used wherever loom needs numbers that must be
// identical on every machine and libtorch version (model generation, adapter
// initialisation, ids). Pure functions; any thread.
#pragma once
#include <cstdint>
#include <string_view>

namespace loom {

// One step of splitmix64: advances state and returns the next 64 random bits.
inline uint64_t SplitMix64Next(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// 64-bit FNV-1a of a byte string.
inline uint64_t Fnv1a64(std::string_view s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001B3ull;
  }
  return h;
}

}  // namespace loom
