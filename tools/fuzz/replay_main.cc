// The main of a fuzz target outside libFuzzer: replays every input file
// named on the command line (files, or directories read recursively), then a
// fixed set of mutations of each (truncations, bit flips, byte runs, spliced
// halves) from a seeded generator, so the same inputs run on every machine.
// This is the CI smoke run of each target (bazel test //...:*_fuzz); real
// fuzzing links libFuzzer's main instead (bazel build --config=fuzz,
// tools/fuzz.sh). A crash or sanitizer report fails the test and the
// failing input is written to $TEST_UNDECLARED_OUTPUTS_DIR (or the cwd).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

namespace {

namespace fs = std::filesystem;

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Written before each run, so the input that crashes is on disk afterwards.
std::string g_current_path;

void run(const std::string& input) {
  {
    std::ofstream f(g_current_path, std::ios::binary | std::ios::trunc);
    f.write(input.data(), static_cast<std::streamsize>(input.size()));
  }
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
}

std::vector<std::string> mutations(const std::string& in, const std::vector<std::string>& all, std::mt19937_64& rng) {
  std::vector<std::string> out;
  const size_t n = in.size();
  for (size_t cut : {size_t{0}, n / 4, n / 2, n > 0 ? n - 1 : 0}) out.push_back(in.substr(0, cut));
  for (int i = 0; i < 24 && n > 0; ++i) {
    std::string m = in;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) m[rng() % n] ^= static_cast<char>(1u << (rng() % 8));
    out.push_back(std::move(m));
  }
  for (uint8_t byte : {0x00, 0xff, 0x7f, 0x80}) {
    if (n == 0) break;
    std::string m = in;
    const size_t at = rng() % n, len = std::min<size_t>(n - at, 1 + rng() % 8);
    for (size_t k = 0; k < len; ++k) m[at + k] = static_cast<char>(byte);
    out.push_back(std::move(m));
  }
  if (!all.empty()) {
    const std::string& other = all[rng() % all.size()];
    out.push_back(in.substr(0, n / 2) + other.substr(other.size() / 2));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
  const char* out_dir = std::getenv("TEST_UNDECLARED_OUTPUTS_DIR");
  g_current_path = std::string(out_dir ? out_dir : ".") + "/fuzz_last_input";
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    fs::path p = argv[i];
    if (p.string().rfind("-", 0) == 0) continue;  // libFuzzer-style flags: ignored here
    if (fs::is_directory(p)) {
      std::vector<fs::path> files;
      for (const auto& e : fs::recursive_directory_iterator(p))
        if (e.is_regular_file()) files.push_back(e.path());
      std::sort(files.begin(), files.end());
      for (const auto& f : files) inputs.push_back(read_all(f));
    } else if (fs::exists(p)) {
      inputs.push_back(read_all(p));
    } else {
      std::fprintf(stderr, "replay: %s does not exist\n", argv[i]);
      return 2;
    }
  }
  if (inputs.empty()) {
    std::fprintf(stderr, "replay: no inputs (give corpus files or directories)\n");
    return 2;
  }
  std::mt19937_64 rng(20261123);
  size_t runs = 0;
  for (const auto& in : inputs) {
    run(in);
    ++runs;
    for (const auto& m : mutations(in, inputs, rng)) {
      run(m);
      ++runs;
    }
  }
  std::printf("replay: %zu corpus inputs and %zu mutations ran without a crash\n", inputs.size(),
              runs - inputs.size());
  std::remove(g_current_path.c_str());
  return 0;
}
