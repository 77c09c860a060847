// ckpt: look into, check and consolidate sharded checkpoints
// (distributed/checkpoint/sharded.h).
//
//   ckpt inspect DIR                 tensors, shapes, dtypes, pieces, sizes,
//                                    which rank's file holds which box of each,
//                                    the mesh it was saved on and each tensor's
//                                    placements (when the saver recorded them)
//   ckpt verify DIR                  every checksum and the coverage of every
//                                    tensor; exits 1 naming the file and tensor
//                                    of the first mismatch
//   ckpt consolidate DIR OUT_DIR     OUT_DIR/model.safetensors (PyTorch's names),
//                                    OUT_DIR/optimizer.safetensors, trainer.json:
//                                    a one-process checkpoint (checkpoint.h)
//
// DIR is one checkpoint: the directory holding index.json. Exit codes: 0 ok,
// 1 a damaged or missing checkpoint, 2 a usage error.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>

#include "distributed/checkpoint/sharded.h"

namespace {

using namespace ember;
using namespace ember::distributed;

int usage() {
  std::cerr << "usage: ckpt inspect DIR | ckpt verify DIR | ckpt consolidate DIR OUT_DIR\n"
               "  DIR is one sharded checkpoint (the directory holding index.json)\n";
  return 2;
}

std::string human(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, ++u;
  char b[32];
  std::snprintf(b, sizeof b, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return b;
}

int inspect(const std::string& dir) {
  auto index = read_checkpoint_index(dir);
  if (!index.ok()) {
    std::cerr << "ckpt: " << index.status().message() << "\n";
    return 1;
  }
  int64_t total = 0, pieces = 0;
  std::map<std::string, std::pair<int64_t, int64_t>> per_file;  // pieces, bytes
  for (const std::string& f : index->files) per_file[f] = {0, 0};
  for (const auto& t : index->tensors)
    for (const auto& p : t.pieces) {
      per_file[p.file].first += 1;
      per_file[p.file].second += p.byte_end - p.byte_begin;
      total += p.byte_end - p.byte_begin;
      ++pieces;
    }
  std::printf("%s: version %d, saved by %d rank(s)%s, layout %s; %zu tensors in %lld pieces, %s\n", dir.c_str(),
              index->version, index->world_size, index->mesh.empty() ? "" : (" on " + index->mesh).c_str(),
              index->layout.c_str(), index->tensors.size(), static_cast<long long>(pieces), human(total).c_str());
  std::printf("\n%-28s %8s %12s  %s\n", "file", "pieces", "data", "on disk");
  for (const auto& [f, pb] : per_file) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(std::filesystem::path(dir) / f, ec);
    std::printf("%-28s %8lld %12s  %s\n", f.c_str(), static_cast<long long>(pb.first), human(pb.second).c_str(),
                ec ? "MISSING" : human(static_cast<double>(size)).c_str());
  }
  std::printf("\n%-52s %-16s %-5s %10s  %s\n", "tensor", "shape", "dtype", "size",
              "pieces (file:box[@run begin+numel])");
  for (const auto& t : index->tensors) {
    int64_t bytes = 0;
    std::string where;
    for (const auto& p : t.pieces) {
      bytes += p.byte_end - p.byte_begin;
      std::string f = p.file;
      if (f.rfind("rank-", 0) == 0) {  // "r3" for rank-00003.safetensors
        char b[16];
        std::snprintf(b, sizeof b, "r%d", std::atoi(f.c_str() + 5));
        f = b;
      }
      // "r0:[0:3,4:8]" for a whole box, "r1:[7:13,0:9]@5+49" for a run of one.
      const auto& r = p.region;
      std::string box = "[";
      for (size_t d = 0; d < r.box.lengths.size(); ++d) {
        if (d) box += ',';
        box += std::to_string(r.box.offsets[d]);
        box += ':';
        box += std::to_string(r.box.offsets[d] + r.box.lengths[d]);
      }
      box += "]";
      if (r.begin != 0 || r.numel != r.box.numel()) {
        box += '@';
        box += std::to_string(r.begin);
        box += '+';
        box += std::to_string(r.numel);
      }
      if (where.size() < 90)
        where += (where.empty() ? "" : " ") + f + ":" + box;
      else if (where.back() != '.')
        where += " ...";
    }
    std::printf("%-52s %-16s %-5s %10s  %zu: %s\n", t.name.c_str(), shape_str(t.shape).c_str(),
                std::string(dtype_name(t.dtype)).substr(0, 5).c_str(), human(bytes).c_str(), t.pieces.size(),
                where.c_str());
  }
  // How each tensor was laid out when saved (its optimizer state alike).
  bool any = false;
  for (const auto& t : index->tensors) {
    if (t.placement.empty() || t.name.rfind("optim.state.", 0) == 0) continue;
    if (!any) std::printf("\n%-52s %s\n", "tensor", "placements when saved");
    any = true;
    std::printf("%-52s %s\n", t.name.c_str(), t.placement.c_str());
  }
  return 0;
}

int verify(const std::string& dir) {
  auto index = read_checkpoint_index(dir);
  if (!index.ok()) {
    std::cerr << "ckpt verify: " << index.status().message() << "\n";
    return 1;
  }
  if (auto s = verify_checkpoint(dir); !s.ok()) {
    std::cerr << "ckpt verify: " << s.message() << "\n";
    return 1;
  }
  int64_t pieces = 0, bytes = 0;
  for (const auto& t : index->tensors)
    for (const auto& p : t.pieces) ++pieces, bytes += p.byte_end - p.byte_begin;
  std::printf("ok: %zu tensors complete, %lld pieces (%s) match their checksums\n", index->tensors.size(),
              static_cast<long long>(pieces), human(static_cast<double>(bytes)).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 3) return usage();
  const std::string cmd = argv[1];
  if (cmd == "inspect" && argc == 3) return inspect(argv[2]);
  if (cmd == "verify" && argc == 3) return verify(argv[2]);
  if (cmd == "consolidate" && argc == 4) {
    if (auto s = consolidate_checkpoint(argv[2], argv[3]); !s.ok()) {
      std::cerr << "ckpt consolidate: " << s.message() << "\n";
      return 1;
    }
    std::printf("wrote %s/model.safetensors, optimizer.safetensors and trainer.json\n", argv[3]);
    return 0;
  }
  return usage();
} catch (const std::exception& e) {  // a damaged checkpoint is exit 1 with a message, never an abort
  std::cerr << "ckpt: " << e.what() << "\n";
  return 1;
}
