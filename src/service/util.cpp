#include "service/util.h"

#include <chrono>
#include <mutex>
#include <random>

namespace loom::service {

namespace {
std::mutex g_mu;
std::mt19937_64& Generator() {
  static std::mt19937_64 gen = [] {
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), rd(), rd(), rd(), rd(), rd(), rd()};
    return std::mt19937_64(seq);
  }();
  return gen;
}
}  // namespace

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

uint64_t RandomU64() {
  std::lock_guard<std::mutex> lock(g_mu);
  return Generator()();
}

std::string RandomHex(int bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  uint64_t word = 0;
  for (int i = 0; i < bytes; ++i) {
    if (i % 8 == 0) word = RandomU64();
    const unsigned b = static_cast<unsigned>(word & 0xff);
    word >>= 8;
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

std::string RandomUuid() {
  std::string h = RandomHex(16);
  h[12] = '4';
  return h.substr(0, 8) + "-" + h.substr(8, 4) + "-" + h.substr(12, 4) + "-" + h.substr(16, 4) + "-" + h.substr(20);
}

}  // namespace loom::service
