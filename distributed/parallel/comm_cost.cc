// CommCostModel (comm_cost.h): the fitter's JSON read and checked, and the
// latency-bandwidth model evaluated.
#include "distributed/parallel/comm_cost.h"

#include <absl/strings/str_cat.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/exception.h"

namespace ember::distributed {

absl::StatusOr<CommCostModel> CommCostModel::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read the collectives' fit"));
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object (bench/collectives_fit.py writes it)"));
  auto ops = j.find("ops");
  if (ops == j.end() || !ops->is_object() || ops->empty())
    return absl::InvalidArgumentError(absl::StrCat(path, ": no \"ops\" object"));
  CommCostModel m;
  for (const auto& [op, sizes] : ops->items()) {
    if (!sizes.is_object())
      return absl::InvalidArgumentError(absl::StrCat(path, ": \"ops\".\"", op, "\" is not an object"));
    for (const auto& [size, f] : sizes.items()) {
      const std::string where = absl::StrCat(path, ": \"ops\".\"", op, "\".\"", size, "\"");
      int p = 0;
      try {
        p = std::stoi(size);
      } catch (const std::exception&) {
        p = 0;
      }
      if (p < 1) return absl::InvalidArgumentError(absl::StrCat(where, ": not a group size"));
      Fit fit;
      for (auto [key, dst] :
           {std::pair{"latency_s", &fit.latency_s}, std::pair{"seconds_per_byte", &fit.seconds_per_byte},
            std::pair{"median_rel_error", &fit.median_rel_error}, std::pair{"max_rel_error", &fit.max_rel_error}}) {
        auto v = f.find(key);
        if (v == f.end() || !v->is_number())
          return absl::InvalidArgumentError(absl::StrCat(where, ": \"", key, "\" is missing or not a number"));
        *dst = v->get<double>();
      }
      m.fits_[op][p] = fit;
    }
  }
  return m;
}

const CommCostModel::Fit& CommCostModel::fit(const std::string& op, int group_size) const {
  auto o = fits_.find(op);
  if (o == fits_.end()) {
    std::string known;
    for (const auto& [name, _] : fits_) known += (known.empty() ? "" : ", ") + name;
    EMBER_CHECK(false, "CommCostModel: no fit for '", op, "' (fitted: ", known, ")");
  }
  auto f = o->second.find(group_size);
  if (f == o->second.end()) {
    std::string sizes;
    for (const auto& [p, _] : o->second) sizes += (sizes.empty() ? "" : ", ") + std::to_string(p);
    EMBER_CHECK(false, "CommCostModel: ", op, " was not measured in a group of ", group_size, " (fitted: ", sizes,
                "; run //bench:collectives_fit at that size)");
  }
  return f->second;
}

double CommCostModel::seconds(const std::string& op, int64_t bytes, int group_size) const {
  EMBER_CHECK(bytes >= 0, "CommCostModel: ", op, " of ", bytes, " bytes");
  const Fit& f = fit(op, group_size);
  return f.latency_s + static_cast<double>(bytes) * f.seconds_per_byte;
}

std::vector<std::string> CommCostModel::ops() const {
  std::vector<std::string> out;
  for (const auto& [op, _] : fits_) out.push_back(op);
  return out;
}

std::vector<int> CommCostModel::group_sizes(const std::string& op) const {
  std::vector<int> out;
  auto o = fits_.find(op);
  if (o != fits_.end())
    for (const auto& [p, _] : o->second) out.push_back(p);
  return out;
}

}  // namespace ember::distributed
