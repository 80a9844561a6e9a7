"""A labelled set of multi-turn sessions (zh + en) for the carry-over's quality numbers.

Each session: messages (turn, role, text), the deictic phrases with the ref a
person would resolve them to, and the snapshot fields a person would keep.
Written by the project (from the seed's three cases, varied), not external data.
"""

from __future__ import annotations

from typing import Any

PATHS = ["/data/orders", "/srv/logs/api", "/mnt/share/q3", "/var/lib/exports", "/home/ops/reports",
         "/data/refunds"]
FILES = ["report_0421.csv", "summary.xlsx", "q3_totals.json", "errors.log", "weekly.md",
         "export_final.parquet"]
SERVICES = [("支付服务", "payment-service"), ("订单服务", "order-service"),
            ("库存服务", "stock-service")]
CITIES = [("北京", "Paris"), ("上海", "Berlin"), ("广州", "Madrid")]
Session = dict[str, Any]
KEEP_TASK = ["task_state", "output_file", "resolved_refs", "confirmed_constraints"]


def _path_file(i: int) -> list[Session]:
    p, f = PATHS[i % len(PATHS)], FILES[i % len(FILES)]
    zh = {"messages": [
        (1, "user", f"把 {p} 里上周的数据按状态汇总，结果写到 {f}"),
        (1, "assistant", "确认按状态分组输出，是否排除已取消的记录？"),
        (2, "user", "不排除，就按刚才那个路径跑"),
    ], "resolve": {"刚才那个路径": p}, "keep": KEEP_TASK}
    en = {"messages": [
        (1, "user", f"Summarize last week's data in {p} by status and write it to {f}"),
        (1, "assistant", "Grouping by status. Should I exclude cancelled records?"),
        (2, "user", "No, keep them, and use that path."),
    ], "resolve": {"that path": p}, "keep": KEEP_TASK}
    return [zh, en]


def _two_candidates(i: int) -> list[Session]:
    (za, ea), (zb, eb) = SERVICES[i % 3], SERVICES[(i + 1) % 3]
    pa, pb = f"/var/log/{ea}", f"/var/log/{eb}"
    earlier = i % 2 == 0
    zh = {"messages": [
        (1, "user", f"先看一下{za}的日志目录 {pa}"),
        (1, "assistant", f"{pa} 下最近有 3 个错误。"),
        (2, "user", f"再看看{zb}的日志目录 {pb}"),
        (2, "assistant", f"{pb} 下最近有 5 个错误。"),
        (3, "user", f"还是看{'前一个' if earlier else '后一个'}，把错误汇总一下"),
    ], "resolve": {("前一个" if earlier else "后一个"): pa if earlier else pb},
        "keep": ["task_state", "resolved_refs", "dropped_candidates"]}
    en = {"messages": [
        (1, "user", f"First look at the {ea} log directory {pa}"),
        (1, "assistant", f"{pa} has 3 recent errors."),
        (2, "user", f"Now the {eb} log directory {pb}"),
        (2, "assistant", f"{pb} has 5 recent errors."),
        (3, "user", f"Let's go with {'the previous one' if earlier else 'the latter'} and "
                    "summarize its errors."),
    ], "resolve": {("the previous one" if earlier else "the latter"): pa if earlier else pb},
        "keep": ["task_state", "resolved_refs", "dropped_candidates"]}
    return [zh, en]


def _closed_qa(i: int) -> list[Session]:
    zc, ec = CITIES[i % 3]
    zh = {"messages": [
        (1, "user", "你好"),
        (2, "user", f"{zc}今天天气怎么样？"),
        (2, "assistant", f"{zc}今天晴，最高 25 度。"),
        (3, "user", "谢谢"),
    ], "resolve": {}, "keep": []}
    en = {"messages": [
        (1, "user", "hello"),
        (2, "user", f"What's the weather in {ec} today?"),
        (2, "assistant", "Sunny, 21 degrees."),
        (3, "user", "thanks"),
    ], "resolve": {}, "keep": []}
    return [zh, en]


def _file_fix(i: int) -> list[Session]:
    f = FILES[(i + 2) % len(FILES)]
    zh = {"messages": [
        (1, "user", f"请检查 {f} 的格式"),
        (1, "assistant", f"{f} 有 2 行格式错误，要我修复吗？"),
        (2, "user", "好的，修复这个文件，保留原始列顺序"),
    ], "resolve": {"这个文件": f}, "keep": ["task_state", "resolved_refs",
                                           "confirmed_constraints"]}
    en = {"messages": [
        (1, "user", f"Please check the format of {f}"),
        (1, "assistant", f"{f} has 2 malformed rows. Do you want me to fix them?"),
        (2, "user", "Yes, fix that file and keep the column order."),
    ], "resolve": {"that file": f}, "keep": ["task_state", "resolved_refs",
                                            "confirmed_constraints"]}
    return [zh, en]


def labelled_sessions() -> list[Session]:
    out: list[Session] = []
    for i in range(6):
        for make in (_path_file, _two_candidates, _closed_qa, _file_fix):
            out += make(i)
    return out
