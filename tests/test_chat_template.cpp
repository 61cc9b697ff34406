// test_chat_template.cpp: chat templates (train/chat_template.cpp) rendered as transformers'
// apply_chat_template renders them.
// - Hand-checked renderings of what every template leans on: trim_blocks and lstrip_blocks,
//   loop variables, undefined names, values printed as Python prints them, tojson, scoping.
// - Errors: syntax errors naming the template and the line, unknown filters and tags by name,
//   undefined values used as values, raise_exception's message.
// - The corpus in tests/data/chat_templates against tests/reference/chat_template_reference.py
//   (Jinja in transformers' environment): family-style templates over the conversations of
//   conversations.json, and one small template per language feature, as cases.json pairs them.
//   Every case renders the same text, or is an Error where Jinja raised. Skips that comparison,
//   with a message, without Debian's python3-jinja2.
#include "testing.h"
#include "train/chat_template.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using test::expect_error;

const fs::path kCorpus = STRATA_CHAT_TEMPLATE_DIR;

std::string render(std::string_view source, const json& context = json::object()) {
  return ChatTemplate(source, "test.jinja").render(context);
}

// Where two renderings first differ, with the bytes around it JSON-escaped: the differences
// that matter here are mostly whitespace, which a plain diff does not show.
std::string first_difference(const std::string& got, const std::string& want) {
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  const size_t from = i < 40 ? 0 : i - 40;
  const auto around = [&](const std::string& s) {
    return json(s.substr(std::min(from, s.size()), 80))
        .dump(-1, ' ', false, json::error_handler_t::replace);
  };
  return "first difference at byte " + std::to_string(i) + "\n  strata: " + around(got) +
         "\n  jinja:  " + around(want);
}

TEST(ChatTemplate, BlocksAreTrimmedAsTransformersConfiguresJinja) {
  // trim_blocks: the newline after a block tag goes; lstrip_blocks: so does the indentation
  // before one that starts its line.
  EXPECT_EQ(render("{% if true %}\nyes\n{% endif %}\ndone"), "yes\ndone");
  EXPECT_EQ(render("<\n  {% for i in [1, 2] %}\n  {{ i }}\n  {% endfor %}\n>"), "<\n  1\n  2\n>");
  // Neither applies to expressions, nor to a tag that does not start its line.
  EXPECT_EQ(render("  {{ 'kept' }}"), "  kept");
  EXPECT_EQ(render("x  {% if true %}y{% endif %}"), "x  y");
  // `-` strips every whitespace character up to the next text, newlines included.
  EXPECT_EQ(render("a {%- if true %} b {% endif -%} c"), "a b c");
  EXPECT_EQ(render("{# note #}\na {#- x -#} b"), "ab");
  // Jinja drops one trailing newline of the source (keep_trailing_newline is off), not two.
  EXPECT_EQ(render("{{ 'x' }}\n{{ 'y' }}\n"), "x\ny");
  EXPECT_EQ(render("a\n\n"), "a\n");
}

TEST(ChatTemplate, LoopVariablesFiltersAndControl) {
  EXPECT_EQ(render("{% for m in ['a', 'b', 'c'] %}{{ loop.index }}{{ loop.index0 }}"
                   "{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}"
                   "{{ loop.length }}{{ m }} {% endfor %}"),
            "1032TrueFalse3a 2121FalseFalse3b 3210FalseTrue3c ");
  EXPECT_EQ(render("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for i in range(6) %}{% if i == 1 %}{% continue %}{% endif %}"
                   "{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}"),
            "023");
  // A loop's filter condition counts only the items it keeps.
  const json messages = json::parse(R"([{"role": "system"}, {"role": "user"},
                                        {"role": "assistant"}])");
  EXPECT_EQ(render("{% for m in messages if m.role != 'system' %}{{ loop.index }}{{ m.role }}"
                   "{% if not loop.last %},{% endif %}{% endfor %}",
                   {{"messages", messages}}),
            "1user,2assistant");
  // Objects iterate in their JSON order, as Python's dicts do.
  EXPECT_EQ(render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
                   {{"d", json::parse(R"({"z": 1, "a": 2})")}}),
            "z=1;a=2;");
}

TEST(ChatTemplate, UndefinedNamesAreEmptyAndFalse) {
  EXPECT_EQ(render("[{{ nothing }}][{{ m.missing }}][{{ m['missing'] }}]{{ nothing is defined }}"
                   "{{ m.missing is defined }}{% if nothing %}T{% else %}F{% endif %}"
                   "{{ nothing | default('d') }}",
                   {{"m", json::object()}}),
            "[][][]FalseFalseFd");
}

TEST(ChatTemplate, ValuesPrintAsPythonPrintsThem) {
  EXPECT_EQ(render("{{ 7 / 2 }} {{ 4 / 2 }} {{ 7 // 2 }} {{ none }} {{ true }} {{ false }} "
                   "{{ ['a', 1] }} {{ {'a': 1} }} {{ 1.0 }} {{ 0.1 + 0.2 }} {{ (1,) }}"),
            "3.5 2.0 3 None True False ['a', 1] {'a': 1} 1.0 0.30000000000000004 (1,)");
  // JSON's 2.0 stays a float and 2 an integer.
  const json context = json::parse(R"({"f": 2.0, "i": 2, "n": null, "b": true,
                                       "l": [1, "a", null], "d": {"k": "v"}})");
  EXPECT_EQ(render("{{ f }} {{ i }} {{ n }} {{ b }} {{ l }} {{ d }}", context),
            "2.0 2 None True [1, 'a', None] {'k': 'v'}");
}

TEST(ChatTemplate, TojsonIsJsonDumpsKeepingUnicodeAndKeyOrder) {
  const json d = json::parse(R"({"z": 1, "a": [true, null, 1.5], "é": "ü<>"})");
  EXPECT_EQ(render("{{ d | tojson }}", {{"d", d}}),
            R"({"z": 1, "a": [true, null, 1.5], "é": "ü<>"})");
  EXPECT_EQ(render("{{ d | tojson(indent=2) }}", {{"d", json::parse(R"({"a": [1]})")}}),
            "{\n  \"a\": [\n    1\n  ]\n}");
}

TEST(ChatTemplate, ASetInsideALoopStaysThereANamespaceDoesNot) {
  EXPECT_EQ(render("{% set n = 0 %}{% set ns = namespace(n=0) %}{% for i in [1, 2, 3] %}"
                   "{% set n = n + i %}{% set ns.n = ns.n + i %}{% endfor %}{{ n }} {{ ns.n }}"),
            "0 6");
}

TEST(ChatTemplate, MacrosCallsAndGenerationBlocks) {
  EXPECT_EQ(
      render("{% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!"
             "{% endmacro %}{{ greet('Ann') }} {{ greet('Bob', greeting='Hi') }} "
             "{% macro box() %}[{{ caller() }}]{% endmacro %}{% call box() %}in{% endcall %}"),
      "Hello, Ann! Hi, Bob! [in]");
  // TRL's assistant markers render as their body, trimmed like any block.
  EXPECT_EQ(render("<{% generation %}\n{{ x }}\n{% endgeneration %}>", {{"x", "body"}}),
            "<body\n>");
}

TEST(ChatTemplate, SyntaxErrorsNameTheTemplateAndTheLine) {
  expect_error([] { ChatTemplate("line one\n{% if true %}unclosed", "unclosed.jinja"); },
               {"unclosed.jinja", "line 2"});
  expect_error([] { ChatTemplate("a\nb\n{{ 1 + }}", "dangling.jinja"); },
               {"dangling.jinja", "line 3"});
  expect_error([] { ChatTemplate("{{ 'unterminated }}", "quote.jinja"); },
               {"quote.jinja", "line 1"});
  expect_error([] { ChatTemplate("a\n{% frobnicate %}", "tag.jinja"); },
               {"tag.jinja", "line 2", "frobnicate"});
  // Jinja refuses an unknown filter when it compiles the template; either stage will do here.
  expect_error(
      [] {
        ChatTemplate t("a\nb\nc\n{{ x | frobnicate }}", "filter.jinja");
        t.render({{"x", 1}});
      },
      {"filter.jinja", "line 4", "frobnicate"});
}

TEST(ChatTemplate, UndefinedValuesUsedAsValuesAreErrors) {
  const auto rendering = [](const char* source) {
    return [source] { ChatTemplate(source, "undefined.jinja").render(json::object()); };
  };
  expect_error(rendering("\n{{ nothing.attr }}"), {"undefined.jinja", "line 2"});
  expect_error(rendering("{{ nothing('x') }}"), {"undefined.jinja", "line 1"});
  expect_error(rendering("a\n\n{{ nothing + 1 }}"), {"undefined.jinja", "line 3"});
  expect_error(rendering("{{ frobnicate('x') }}"), {"undefined.jinja", "frobnicate"});
}

TEST(ChatTemplate, RaiseExceptionIsAnErrorHoldingItsMessage) {
  expect_error(
      [] {
        ChatTemplate("ok\n{{ raise_exception('bad role') }}", "raise.jinja").render(json::object());
      },
      {"bad role", "raise.jinja", "line 2"});
}

// A template is downloaded input: one that recurses, nests, grows or loops without end is an
// Error, not a crash, an exhausted memory or a hang.
TEST(ChatTemplate, RunawayTemplatesAreStopped) {
  const auto rendering = [](std::string source) {
    return [source] { ChatTemplate(source, "runaway.jinja").render(json::object()); };
  };
  expect_error(rendering("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}\n{{ f(0) }}"),
               {"runaway.jinja", "nested more than 200 deep"});
  expect_error(rendering("{{ " + std::string(300, '[') + std::string(300, ']') + " }}"),
               {"runaway.jinja line 1", "nested more than 200 deep"});
  // (Each check is cheap: the size is known before the text is made.)
  expect_error(rendering("{{ 'x' * 1000000 * 1000 }}"), {"runaway.jinja", "256 MiB"});
  expect_error(rendering("{{ (['x'] * 2000000) | length }}"),
               {"runaway.jinja", "a list of", "items"});
  expect_error(rendering("{{ range(2000000) | length }}"), {"a list of", "items"});
  expect_error(
      rendering("{% for i in range(1100) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"),
      {"runaway.jinja line 1", "loop iterations"});
  // A namespace that would hold itself (a cycle never freed) is refused.
  expect_error(rendering("{% set ns = namespace(a=1) %}\n{% set ns.b = [ns] %}"),
               {"runaway.jinja line 2", "could hold itself"});
  // A macro holds the scope that defines it weakly (it is held by it): one called while that
  // scope lives works, also from a loop inside it.
  EXPECT_EQ(ChatTemplate("{% macro m(x) %}<{{ x }}>{% endmacro %}{% for i in [1, 2] %}{{ m(i) }}"
                         "{% endfor %}",
                         "macro.jinja")
                .render(json::object()),
            "<1><2>");
}

// Jinja's split() of a safe string gives safe pieces; strata does not track them, so it refuses
// rather than render them differently.
TEST(ChatTemplate, SplittingASafeStringIsRefused) {
  expect_error(
      [] { ChatTemplate("{{ ('a b'|safe).split() }}", "safe.jinja").render(json::object()); },
      {"safe.jinja line 1", "split() of a safe string"});
  EXPECT_EQ(ChatTemplate("{{ 'a b'.split() }}", "plain.jinja").render(json::object()),
            "['a', 'b']");
}

TEST(ChatTemplate, OneParseRendersManyContextsTheSameEveryTime) {
  ChatTemplate t(
      "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{% endfor %}"
      "{% if add_generation_prompt %}<assistant>{% endif %}",
      "many.jinja");
  EXPECT_EQ(t.name(), "many.jinja");
  std::vector<json> contexts;
  for (int i = 0; i < 3; ++i) {
    json messages = json::array();
    for (int j = 0; j <= i; ++j)
      messages.push_back({{"role", j % 2 ? "assistant" : "user"},
                          {"content", " turn " + std::to_string(j) + " "}});
    contexts.push_back({{"messages", messages}, {"add_generation_prompt", i % 2 == 0}});
  }
  const std::vector<std::string> want = {
      "<user>turn 0<assistant>",
      "<user>turn 0<assistant>turn 1",
      "<user>turn 0<assistant>turn 1<user>turn 2<assistant>",
  };
  for (int round = 0; round < 2; ++round)
    for (size_t i = 0; i < contexts.size(); ++i) EXPECT_EQ(t.render(contexts[i]), want[i]);
  const ChatTemplate moved = std::move(t);
  EXPECT_EQ(moved.render(contexts[2]), want[2]);
}

// The corpus: what cases.json lists, expanded into the contexts rendered.
struct Case {
  std::string file;   // the template, relative to kCorpus
  std::string label;  // which conversation or context, for the trace
  json context;
  std::string raises;  // the raise_exception message expected, if any
  bool fails = false;  // Jinja itself stops on it
};

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

json manifest() {
  return json::parse(read_text(kCorpus / "cases.json"));
}

// Families: every conversation with add_generation_prompt false and true, the context laid out
// as apply_chat_template passes it (tools null when there are none), then the family's tokens
// and extra variables. Features: each context as given.
std::vector<Case> corpus_cases() {
  const json m = manifest();
  const json conversations =
      json::parse(read_text(kCorpus / m.at("conversations").get<std::string>()));
  std::vector<Case> cases;
  for (const json& family : m.at("families")) {
    const std::string file = family.at("template").get<std::string>();
    const json raises = family.value("raises", json::object());
    const json tokens = family.at("tokens");
    const json extra = family.value("extra", json::object());
    for (const json& entry : family.at("conversations")) {
      const std::string name = entry.get<std::string>();
      const json& conversation = conversations.at(name);
      for (const bool prompt : {false, true}) {
        json context = {{"messages", conversation.at("messages")},
                        {"tools", conversation.contains("tools") ? conversation["tools"] : json()},
                        {"add_generation_prompt", prompt}};
        for (const json* vars : {&tokens, &extra})
          for (auto it = vars->begin(); it != vars->end(); ++it) context[it.key()] = it.value();
        const std::string label = name + ", add_generation_prompt=" + (prompt ? "true" : "false");
        cases.push_back({file, label, std::move(context), raises.value(name, ""), false});
      }
    }
  }
  for (const json& feature : m.at("features"))
    for (const json& c : feature.at("contexts"))
      cases.push_back({feature.at("template").get<std::string>(), c.at("name").get<std::string>(),
                       c.at("context"), c.value("raises", ""), c.value("fails", false)});
  return cases;
}

// The templates cases.json names, in its order, each once.
std::vector<std::string> corpus_files() {
  std::vector<std::string> files;
  try {
    const json m = manifest();
    for (const char* section : {"families", "features"})
      for (const json& entry : m.at(section)) {
        const std::string file = entry.at("template").get<std::string>();
        if (std::find(files.begin(), files.end(), file) == files.end()) files.push_back(file);
      }
  } catch (const std::exception&) {
    // CorpusManifest.ListsEveryTemplateOnceAndEveryCaseExpands reports it.
  }
  return files;
}

TEST(CorpusManifest, ListsEveryTemplateOnceAndEveryCaseExpands) {
  std::set<std::string> on_disk;
  for (const auto& entry : fs::recursive_directory_iterator(kCorpus))
    if (entry.path().extension() == ".jinja")
      on_disk.insert(entry.path().lexically_relative(kCorpus).generic_string());
  const std::vector<std::string> listed = corpus_files();
  EXPECT_EQ(std::set<std::string>(listed.begin(), listed.end()), on_disk);
  EXPECT_GE(listed.size(), 30u);
  std::vector<Case> cases;
  ASSERT_NO_THROW(cases = corpus_cases());
  EXPECT_GE(cases.size(), 200u);
}

// The reference's rendering of every case, run once for all the tests below.
struct ReferenceRun {
  bool missing_jinja = false;
  std::string failure;  // why there is no result
  std::vector<Case> cases;
  json out;
};

const ReferenceRun& reference_run() {
  static const ReferenceRun run = [] {
    ReferenceRun r;
    try {
      r.cases = corpus_cases();
      test::TempDir tmp("strata-chat-template");
      json input = json::array();
      for (const Case& c : r.cases)
        input.push_back({{"template", read_text(kCorpus / c.file)}, {"context", c.context}});
      const fs::path in_path = tmp.path / "cases.json", out_path = tmp.path / "out.json";
      std::ofstream(in_path) << input.dump();
      const test::CommandResult ran =
          test::run_command(std::string("'") + STRATA_PYTHON + "' '" + STRATA_REFERENCE_DIR +
                            "/chat_template_reference.py' render '" + in_path.string() + "' '" +
                            out_path.string() + "' 2>&1");
      if (ran.status == 77) {
        r.missing_jinja = true;
      } else if (ran.status != 0) {
        r.failure = "the reference exited with " + std::to_string(ran.status) + ": " + ran.out;
      } else {
        r.out = json::parse(read_text(out_path));
        if (r.out.size() != r.cases.size())
          r.failure = "the reference rendered " + std::to_string(r.out.size()) + " of " +
                      std::to_string(r.cases.size()) + " cases";
      }
    } catch (const std::exception& e) {
      r.failure = std::string("the corpus: ") + e.what();
    }
    return r;
  }();
  return run;
}

// Every case of one template against the reference's rendering.
void check_template(const ReferenceRun& run, const std::string& file) {
  SCOPED_TRACE(file);
  std::optional<ChatTemplate> t;
  try {
    t.emplace(read_text(kCorpus / file), file);
  } catch (const Error& e) {
    ADD_FAILURE() << file << " does not parse: " << e.what();
    return;
  }
  int checked = 0;
  for (size_t i = 0; i < run.cases.size(); ++i) {
    const Case& c = run.cases[i];
    if (c.file != file) continue;
    ++checked;
    SCOPED_TRACE(file + " with " + c.label);
    const json& ref = run.out[i];
    // What Jinja did must be what the corpus says it does, or the corpus is wrong.
    const std::string kind = ref.value("kind", "");
    if (!c.raises.empty()) {
      if (kind != "raise_exception" || ref.value("error", "") != c.raises) {
        ADD_FAILURE() << "the corpus expects raise_exception(" << json(c.raises).dump()
                      << ") but the reference gave " << ref.dump();
        continue;
      }
    } else if (c.fails != (kind == "exception") || kind == "raise_exception") {
      ADD_FAILURE() << "the corpus expects " << (c.fails ? "Jinja to fail" : "a rendering")
                    << " but the reference gave " << ref.dump();
      continue;
    }

    std::string text, error;
    std::vector<std::pair<uint64_t, uint64_t>> spans;
    try {
      text = t->render(c.context, &spans);
    } catch (const Error& e) {
      error = e.what();
      if (error.empty()) error = "(an Error with no message)";
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a strata::Error: " << e.what();
      continue;
    }
    if (ref.contains("text")) {
      if (!error.empty()) {
        ADD_FAILURE() << "strata failed: " << error;
        continue;
      }
      const std::string want = ref["text"].get<std::string>();
      EXPECT_EQ(text, want) << first_difference(text, want);
      // Where {% generation %} blocks wrote, as transformers records it for assistant masks.
      std::vector<std::pair<uint64_t, uint64_t>> want_spans;
      for (const json& span : ref.value("generation", json::array()))
        want_spans.emplace_back(span[0].get<uint64_t>(), span[1].get<uint64_t>());
      EXPECT_EQ(spans, want_spans);
      EXPECT_EQ(t->has_generation(),
                read_text(kCorpus / file).find("generation %}") != std::string::npos);
    } else if (error.empty()) {
      ADD_FAILURE() << "Jinja raised " << ref["error"].dump() << " but strata rendered "
                    << json(text).dump();
    } else if (!c.raises.empty()) {
      EXPECT_NE(error.find(c.raises), std::string::npos)
          << "'" << c.raises << "' missing from: " << error;
    }
  }
  EXPECT_GT(checked, 0) << "cases.json has no case for " << file;
}

// One test for the whole corpus: the reference (a Python process) runs once, and each failure
// names its template and case.
TEST(ChatTemplateReference, EveryCorpusTemplateRendersAsJinjaDoes) {
  const ReferenceRun& run = reference_run();
  if (run.missing_jinja)
    GTEST_SKIP() << "Python's jinja2 module is missing; install python3-jinja2 to compare with "
                    "the reference";
  ASSERT_TRUE(run.failure.empty()) << run.failure;
  for (const std::string& file : corpus_files()) check_template(run, file);
}

}  // namespace
}  // namespace strata
