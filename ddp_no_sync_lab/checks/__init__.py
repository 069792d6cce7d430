"""verify.py's judgement of a run folder: each item of the document's checklist against the witnesses, the strict
audit, and every fact the run's files hold.

    certify       each checklist item against the witnesses, one function per item; the checklist's table
    strict_audit  the strict audit: the documented experiment key by key, on real data, learned
    facts         the facts verify.py checks, one function per artifact or fact
    task_results  each task's own results checked, found by the task the runs recorded
"""
