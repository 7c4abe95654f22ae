"""dspark.tools"""
