// The training examples' flags, each declared once: one row of a table
// with its name, value, help and validation. The table parses argv
// ("--flag value" and "--flag=value"), prints --help from its rows (with
// each flag's default), and lists the values the ranks must agree on
// (distributed::check_same_config). The rows every trainer has
// (add_common_flags) are shared by //examples:resnet_ddp and //examples:gpt.
//
//   Flags f;                                           // defaults in the struct
//   examples::FlagTable t("gpt", "usage: gpt [flags]");
//   examples::add_common_flags(t, f.common, "sequences", "peak learning rate");
//   t.integer("--layers", &f.layers, 1, "N", "transformer blocks");
//   t.choice("--sp", &f.sp, {"on", "off", "auto"}, "sequence parallelism inside tp");
//   t.parse(argc, argv);                              // exits 2 with the usage on a bad flag
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/exception.h"
#include "distributed/parallel_dims.h"
#include "examples/cli.h"
#include "nn/checkpoint.h"

namespace ember::examples {

class FlagTable {
 public:
  FlagTable(const char* program, std::string head) : program_(program), head_(std::move(head)) {}
  // Rows hold pointers into the table (their checks call error()).
  FlagTable(const FlagTable&) = delete;
  FlagTable& operator=(const FlagTable&) = delete;

  // A row: `parse` sets the value from the text (and validates it, calling
  // error()); `show` gives the value as text (the default in --help, the
  // value ranks compare). `agree`: the ranks must give the same value
  // (paths and --nproc may differ by host).
  struct Row {
    std::string name, metavar, help;
    std::function<void(const std::string&)> parse;
    std::function<std::string()> show;
    bool is_switch = false, agree = true;
  };
  FlagTable& add(Row row) {
    rows_.push_back(std::move(row));
    return *this;
  }

  // Integers >= min (min -1 admits "-1: the rest").
  template <typename Int>
  FlagTable& integer(const std::string& name, Int* v, int64_t min, const std::string& metavar, const std::string& help,
                     bool agree = true) {
    return add({name, metavar, help,
                [this, name, v, min](const std::string& s) { *v = static_cast<Int>(parse_int(name, s, min)); },
                [v] { return std::to_string(*v); }, false, agree});
  }
  FlagTable& positive(const std::string& name, double* v, const std::string& metavar, const std::string& help) {
    return add({name, metavar, help, [this, name, v](const std::string& s) { *v = parse_positive(name, s); },
                [v] { return format_number(*v); }});
  }
  // Real numbers >= 0 (a coefficient that may be off).
  FlagTable& nonnegative(const std::string& name, double* v, const std::string& metavar, const std::string& help) {
    return add({name, metavar, help,
                [this, name, v](const std::string& s) {
                  char* end = nullptr;
                  const double x = std::strtod(s.c_str(), &end);
                  if (s.empty() || *end != '\0' || !std::isfinite(x) || x < 0)
                    error(name + " needs a number >= 0, got '" + s + "'");
                  *v = x;
                },
                [v] { return format_number(*v); }});
  }
  FlagTable& text(const std::string& name, std::string* v, const std::string& metavar, const std::string& help,
                  bool agree = true) {
    return add({name, metavar, help, [v](const std::string& s) { *v = s; }, [v] { return *v; }, false, agree});
  }
  // One of `choices`; the metavar lists them.
  FlagTable& choice(const std::string& name, std::string* v, const std::vector<std::string>& choices,
                    const std::string& help) {
    std::string list, words;  // "a|b|c", "a, b or c"
    for (size_t i = 0; i < choices.size(); ++i) {
      list += (i ? "|" : "") + choices[i];
      words += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
    }
    return add({name, list, help,
                [this, name, v, choices, words](const std::string& s) {
                  if (std::find(choices.begin(), choices.end(), s) == choices.end())
                    error(name + " takes " + words + ", got '" + s + "'");
                  *v = s;
                },
                [v] { return *v; }});
  }
  FlagTable& toggle(const std::string& name, bool* v, const std::string& help) {
    return add({name, "", help, [v](const std::string&) { *v = true; }, [v] { return *v ? "on" : "off"; }, true});
  }

  // Parses argv; --help / -h prints usage() and exits 0; an unknown flag, a
  // missing or bad value exits 2 with the message and the usage.
  void parse(int argc, char** argv) {
    if (defaults_.empty()) take_defaults();
    usage_text_ = usage();  // once: cli() hands out pointers into it
    for (FlagReader r(cli(), argc, argv); r.next();) {
      const Row* row = find(r.flag());
      if (row == nullptr) error("unknown flag '" + r.flag() + "'");
      if (row->is_switch) r.no_value();
      row->parse(row->is_switch ? "" : r.value());
      given_.insert(row->name);
    }
  }
  bool given(const std::string& name) const { return given_.count(name) > 0; }

  // "usage: ...", then a line a flag: name and value, help, (default X).
  std::string usage() const {
    std::ostringstream os;
    os << head_ << "\n";
    for (const Row& r : rows_) {
      std::string lead = "  " + r.name + (r.metavar.empty() ? "" : " " + r.metavar);
      if (lead.size() < 26)
        lead.resize(26, ' ');
      else
        lead += "\n" + std::string(26, ' ');
      std::string help = r.help;
      if (!r.is_switch && !defaults_.empty() && help.find("(default") == std::string::npos)
        help += " (default " + shown(defaults_.at(r.name)) + ")";
      // Continuation lines of a long help keep the column.
      for (size_t at = 0; (at = help.find('\n', at)) != std::string::npos; at += 27) help.insert(at + 1, 26, ' ');
      os << lead << help << "\n";
    }
    return os.str();
  }
  // The defaults shown by usage(): the values before parse(), taken once.
  void take_defaults() {
    for (const Row& r : rows_) defaults_[r.name] = r.show();
  }

  // The values the ranks compare, by flag.
  std::vector<std::pair<std::string, std::string>> agreed_values() const {
    std::vector<std::pair<std::string, std::string>> out;
    for (const Row& r : rows_)
      if (r.agree) out.emplace_back(r.name, r.show());
    return out;
  }

  // Errors and number parsing are the Cli's (examples/cli.h), with the
  // table's usage.
  [[noreturn]] void error(const std::string& msg) const { cli().error(msg); }
  int64_t parse_int(const std::string& flag, const std::string& v, int64_t min) const {
    return cli().parse_int(flag, v, min);
  }
  double parse_positive(const std::string& flag, const std::string& v) const { return cli().parse_positive(flag, v); }
  // The Cli (program name and usage text) launch_and_train reports with.
  const Cli& cli() const {
    if (usage_text_.empty()) usage_text_ = usage();
    cli_ = Cli{program_, usage_text_.c_str()};
    return cli_;
  }

 private:
  const Row* find(const std::string& name) const {
    for (const Row& r : rows_)
      if (r.name == name) return &r;
    return nullptr;
  }
  static std::string shown(const std::string& v) { return v.empty() ? "none" : v; }
  static std::string format_number(double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return buf;
  }

  const char* program_;
  std::string head_;
  std::vector<Row> rows_;
  std::map<std::string, std::string> defaults_;
  std::set<std::string> given_;
  mutable std::string usage_text_;
  mutable Cli cli_{nullptr, nullptr};
};

// What every trainer takes. Defaults are the program's (set them in its
// Flags before add_common_flags).
struct CommonFlags {
  int nproc = 0;  // 0: one per GPU, else 2
  int64_t batch_size = 16;
  int64_t accum_steps = 1;
  double lr = 1e-3;
  std::string amp = "off";
  std::string ac = "none";
  std::string checkpoint_dir;
  bool resume = false, overwrite = false, deterministic = false;
  uint64_t seed = 0;
  std::string data;
  double timeout_sec = 0;
  std::string profile_dir;
};

// `unit`: what a batch holds ("images", "sequences"); `lr_help`: what --lr means there.
inline void add_common_flags(FlagTable& t, CommonFlags& f, const std::string& unit, const std::string& lr_help) {
  t.integer("--nproc", &f.nproc, 1, "N",
            "local worker processes, ignored under a launcher (default: one per GPU, else 2)", false);
  t.integer("--batch-size", &f.batch_size, 1, "N", unit + " per rank per micro-batch");
  t.integer("--accum-steps", &f.accum_steps, 1, "K", "micro-batches per optimizer step (gradient accumulation)");
  t.positive("--lr", &f.lr, "X", lr_help);
  t.choice("--amp", &f.amp, {"off", "bf16", "fp16"},
           "mixed precision: bfloat16, or float16 with a loss scaler agreed across ranks");
  t.add({"--ac", "none|full|selective|every:K",
         "activation checkpointing of the blocks: all, all keeping the outputs of the costly ops\n"
         "(matmuls, convolutions, collectives: selective), or every K-th block",
         [&t, &f](const std::string& s) {
           try {
             nn::ActivationCheckpointing::parse(s);
           } catch (const Error& e) {
             t.error(std::string("--ac: ") + e.what());
           }
           f.ac = s;
         },
         [&f] { return f.ac; }});
  t.text("--checkpoint-dir", &f.checkpoint_dir, "D", "where the checkpoints go", false);
  t.toggle("--resume", &f.resume, "continue from the newest checkpoint in --checkpoint-dir");
  t.toggle("--overwrite", &f.overwrite, "a fresh run may replace the checkpoints in --checkpoint-dir (else an error)");
  t.integer("--seed", &f.seed, 0, "N", "initialisation and data order");
  t.toggle("--deterministic", &f.deterministic,
           "the same bits on every run on the same GPU: attention's dQ in a pass of its own, only\n"
           "deterministic cuDNN algorithms (set_deterministic_algorithms; the CPU always is)");
  t.text("--data", &f.data, "PATH", "the training data, or 'synthetic'", false);
  t.add({"--timeout", "SEC", "rendezvous and collective timeout (default: $EMBER_DIST_TIMEOUT_SEC, else 600)",
         [&t, &f](const std::string& s) { f.timeout_sec = t.parse_positive("--timeout", s); },
         [&f] { return f.timeout_sec > 0 ? std::to_string(f.timeout_sec) : std::string(); }, false, false});
  t.add({"--profile", "DIR",
         "profile 3 steps after 3 warm-up steps (fewer when fewer are left): Chrome traces\n"
         "per rank and merged (DIR/trace.json), and the top ops by self time",
         [&t, &f](const std::string& s) {
           if (s.empty()) t.error("--profile needs a directory");
           f.profile_dir = s;
         },
         [&f] { return f.profile_dir; }, false, false});
}

// The mesh's degrees, straight into a ParallelDims (-1: the rest; at most
// one): a row per entry of ParallelDims::flags().
inline void add_mesh_flags(FlagTable& t, distributed::ParallelDims& d) {
  for (const auto& flag : distributed::ParallelDims::flags())
    t.integer(flag.name, &(d.*flag.degree), flag.min, flag.metavar, flag.help);
}

// A trainer's main: its Flags declared and parsed by the declare and
// parse_flags that argument-dependent lookup finds for them, then
// train(flags, table) through launch_and_train (--nproc spawns the ranks).
template <typename Flags, typename Train>
int flags_main(const char* program, const char* usage, int argc, char** argv, Train train) {
  Flags flags;
  FlagTable table(program, usage);
  declare(table, flags);
  parse_flags(table, flags, argc, argv);
  return launch_and_train(table.cli(), flags.common.nproc, argc, argv, [&] {
    if (flags.common.deterministic) set_deterministic_algorithms(true);
    return train(flags, table);
  });
}

}  // namespace ember::examples
