// ckpt: look into, check and consolidate sharded checkpoints
// (distributed/checkpoint/sharded.h), and export them as Hugging Face
// directories (nn/hf.h).
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
//   ckpt export-hf DIR OUT_DIR       a Hugging Face directory (nn/hf.h): config.json,
//                                    model.safetensors and the run's tokenizer.json
//                                    if it recorded one; from_pretrained loads it
//   ckpt logits SRC IDS OUT          the logits of the model for token ids "3,1,4/1,5,9"
//                                    (rows split by '/') into OUT (safetensors "ids",
//                                    "logits"); SRC a checkpoint or a Hugging Face
//                                    directory (what tools/hf_compare.py compares)
//
// DIR is one checkpoint: the directory holding index.json (export-hf and
// logits also take a one-process checkpoint, checkpoint.h's). Exit codes: 0
// ok, 1 a damaged or missing checkpoint or bad input, 2 a usage error.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/ops.h"
#include "core/safetensors.h"
#include "distributed/checkpoint/sharded.h"
#include "nn/hf.h"

namespace {

using namespace ember;
using namespace ember::distributed;

int usage() {
  std::cerr << "usage: ckpt inspect DIR | ckpt verify DIR | ckpt consolidate DIR OUT_DIR\n"
               "       ckpt export-hf DIR OUT_DIR | ckpt logits SRC IDS OUT\n"
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

// A GPT checkpoint's model: the options the run recorded in trainer.json
// ("extra": {"model": {...}}, nn::gpt_options_to_json) and the model's
// tensors whole: a sharded checkpoint's pieces put together as consolidate
// does (so any mesh), or a one-process checkpoint's file.
struct CheckpointModel {
  nn::GPTOptions options;
  nn::StateDict state;
  std::string tokenizer;  // the run's tokenizer.json, if it recorded one
};

absl::StatusOr<CheckpointModel> read_checkpoint_model(const std::string& dir) {
  namespace fs = std::filesystem;
  CheckpointModel m;
  const std::string trainer = (fs::path(dir) / "trainer.json").string();
  std::ifstream in(trainer);
  if (!in) return absl::NotFoundError(trainer + ": missing file (is " + dir + " a checkpoint?)");
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json extra;
  try {
    extra = nlohmann::json::parse(text.str()).at("extra");
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(trainer + ": no \"extra\" object: " + e.what());
  }
  if (!extra.is_object() || !extra.contains("model"))
    return absl::InvalidArgumentError(
        trainer +
        ": the run recorded no model options (extra.model: arch, sizes, heads, vocab...), which config.json "
        "is made from; //examples:gpt records them in every checkpoint it writes");
  auto o = nn::gpt_options_from_json(extra.at("model").dump(), trainer + " extra.model");
  if (!o.ok()) return o.status();
  m.options = *o;
  // The tokenizer: tokenizer.json inside the checkpoint, or the file the
  // run recorded (extra.tokenizer, a path); neither: a model without one.
  if (fs::is_regular_file(fs::path(dir) / "tokenizer.json")) {
    m.tokenizer = (fs::path(dir) / "tokenizer.json").string();
  } else if (extra.contains("tokenizer") && extra.at("tokenizer").is_string()) {
    m.tokenizer = extra.at("tokenizer").get<std::string>();
    if (!fs::is_regular_file(m.tokenizer))
      return absl::NotFoundError(trainer + ": the run's tokenizer " + m.tokenizer + " (extra.tokenizer) is gone");
  }
  if (is_sharded_checkpoint(dir)) {
    auto index = read_checkpoint_index(dir);
    if (!index.ok()) return index.status();
    for (const CheckpointTensor& t : index->tensors) {
      // The optimizer's state and the ranks' generators are not the model's
      // (sharded.h's names: "optim.state.*", "rng.<rank>").
      if (t.name.rfind("optim.", 0) == 0 || t.name.rfind("rng.", 0) == 0) continue;
      auto v = read_checkpoint_tensor(dir, t);
      if (!v.ok()) return v.status();
      m.state.insert(t.name, *v);
    }
  } else {
    auto f = load_safetensors((fs::path(dir) / "model.safetensors").string());
    if (!f.ok()) return f.status();
    for (auto& [name, t] : f->tensors) m.state.insert(name, t);
  }
  return m;
}

int export_hf(const std::string& dir, const std::string& out) {
  auto m = read_checkpoint_model(dir);
  if (!m.ok()) {
    std::cerr << "ckpt export-hf: " << m.status().message() << "\n";
    return 1;
  }
  nn::HFSaveOptions save;
  if (!m->tokenizer.empty()) save.extra_files["tokenizer.json"] = m->tokenizer;
  if (auto s = nn::save_hf_pretrained(m->state, m->options, out, save); !s.ok()) {
    std::cerr << "ckpt export-hf: " << s.message() << "\n";
    return 1;
  }
  std::printf("wrote %s/config.json (%s, %lld layers, vocab %lld), model.safetensors%s\n", out.c_str(),
              nn::arch_name(m->options.arch), static_cast<long long>(m->options.n_layer),
              static_cast<long long>(m->options.vocab_size), m->tokenizer.empty() ? "" : " and tokenizer.json");
  return 0;
}

int logits(const std::string& src, const std::string& ids_text, const std::string& out) {
  // "3,1,4/1,5,9": rows of one length.
  std::vector<std::vector<double>> rows(1);
  std::string num;
  for (char c : ids_text + ",") {
    if (c >= '0' && c <= '9') {
      num += c;
      continue;
    }
    if (c != ',' && c != '/') {
      std::cerr << "ckpt logits: IDS is token ids like 3,1,4/1,5,9, got '" << ids_text << "'\n";
      return 2;
    }
    if (!num.empty()) rows.back().push_back(std::stod(num)), num.clear();
    if (c == '/') rows.emplace_back();
  }
  for (const auto& r : rows)
    if (r.empty() || r.size() != rows[0].size()) {
      std::cerr << "ckpt logits: IDS rows must be non-empty and of one length, got '" << ids_text << "'\n";
      return 2;
    }
  std::vector<double> flat;
  for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
  const Tensor ids = Tensor::from_vector(
      flat, {static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows[0].size())}, DType::Int64);
  nn::GPTOptions options;
  nn::StateDict state;
  auto fail = [](const absl::Status& s) {
    std::cerr << "ckpt logits: " << s.message() << "\n";
    return 1;
  };
  if (std::filesystem::exists(std::filesystem::path(src) / "config.json")) {  // a Hugging Face directory
    auto m = nn::load_hf_pretrained(src);
    if (!m.ok()) return fail(m.status());
    options = m->options, state = m->state;
  } else {
    auto m = read_checkpoint_model(src);
    if (!m.ok()) return fail(m.status());
    options = m->options, state = m->state;
  }
  options.dropout = 0;
  nn::GPT gpt(options);
  gpt.load_state_dict(state);
  gpt.eval();
  const Tensor y = gpt(ids);
  if (auto s = save_safetensors(out, {{"ids", ids}, {"logits", y}}, {{"format", "pt"}}); !s.ok()) return fail(s);
  std::printf("%s: %s logits %s, max |logit| %.6g -> %s\n", src.c_str(), nn::arch_name(options.arch),
              shape_str(y.sizes()).c_str(), max(abs(y)).item(), out.c_str());
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
  if (cmd == "export-hf" && argc == 4) return export_hf(argv[2], argv[3]);
  if (cmd == "logits" && argc == 5) return logits(argv[2], argv[3], argv[4]);
  return usage();
} catch (const std::exception& e) {  // a damaged checkpoint is exit 1 with a message, never an abort
  std::cerr << "ckpt: " << e.what() << "\n";
  return 1;
}
