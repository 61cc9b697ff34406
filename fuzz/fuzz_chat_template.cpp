// fuzz_chat_template.cpp: the chat template reader and interpreter on arbitrary bytes.
//
// The input is a template's text, as a model directory's chat_template.jinja holds it. When it
// parses, it is rendered with a conversation (system, user, an assistant tool call, the tool's
// result, an assistant reply) and tools, with and without the generation prompt, as
// `strata tokenize` renders a "messages" row. A strata::Error is the template being refused or
// raising; anything else (a crash, a hang, a runaway allocation) is a finding.
#include "core/error.h"
#include "train/chat_template.h"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::ordered_json context = nlohmann::ordered_json::parse(R"({
    "bos_token": "<s>", "eos_token": "</s>",
    "messages": [
      {"role": "system", "content": "Be brief. "},
      {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
      {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function":
        {"name": "weather", "arguments": {"city": "Paris", "days": 2}}}]},
      {"role": "tool", "content": "{\"temp\": 21.5}"},
      {"role": "assistant", "content": " It is 21.5 \u00b0C. \ud83c\udf24"}
    ],
    "tools": [{"type": "function", "function": {"name": "weather", "parameters":
      {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
  })");
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const strata::ChatTemplate t(text, "fuzz.jinja");
    for (const bool prompt : {false, true}) {
      nlohmann::ordered_json c = context;
      c["add_generation_prompt"] = prompt;
      try {
        (void)t.render(c);
      } catch (const strata::Error&) {
      }
    }
  } catch (const strata::Error&) {
    return 0;  // refused: expected for most inputs
  }
  return 0;
}
